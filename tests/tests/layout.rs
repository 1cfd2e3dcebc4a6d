//! The workspace's structural rules, checked on the sources so they stay
//! true as the code grows:
//!
//! - no import cycle between the modules of a crate;
//! - in `target-rdma`, data flows one way: the client side (`client`,
//!   `replica`, `block`) never names the server side (`store`, `arenad`)
//!   and the server side never names the client side; the shared
//!   vocabulary (`blob`, `proto`, `auth`, the verbs layer `rdma`, ...)
//!   names neither;
//! - no source file holds more than [`MAX_LINES`] lines of non-test code
//!   (the wire codec excepted: one table of frames reads best in one file);
//! - a type's inherent `impl` blocks live in one file, so that a file, not
//!   a scattering of them, shows what the type does (the exceptions, each
//!   with its reason, in [`SPREAD_IMPLS`]);
//! - in the folders of [`VOCABULARY_IN_LEAVES`], no file imports an item
//!   its folder's `mod.rs` defines: shared vocabulary lives in a leaf file
//!   (`store/error.rs`, ...) and `mod.rs` only declares and re-exports, so
//!   that imports never run back up inside the folder;
//! - no source file writes an event name as a string literal
//!   (`event = "..."`): every event is a constant of its daemon's events
//!   module (`ublk_metrics::events`, `target_rdma::arenad::events`), which
//!   the docs test checks against `docs/`.
//!
//! The graph comes from the text: every `use` tree and every path written
//! `crate::..`, `super::..` or `self::..` is resolved to the longest prefix
//! that names a module (file or inline), giving an edge from the module it
//! appears in. An edge between two modules counts at the level of their
//! nearest common ancestor: `a::x -> b::y` is an edge `a -> b` among the
//! children of the crate root, `a::x -> a::y` an edge `x -> y` among the
//! children of `a`. Edges between a module and its own ancestor or
//! descendant (a child's `use super::*`) are how Rust modules nest and are
//! not counted. A cycle is a strongly connected component of one of these
//! sibling graphs.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Longest non-test part of a source file.
const MAX_LINES: usize = 900;

/// Files allowed over [`MAX_LINES`], each with the reason.
const LONG_FILES: &[(&str, &str)] = &[("target-rdma/src/proto.rs", "the wire codec")];

/// Types whose inherent `impl` blocks are still spread over several files
/// (crate, type), each with the reason; being split up separately.
const SPREAD_IMPLS: &[(&str, &str, &str)] = &[
    (
        "daemon",
        "DeviceObs",
        "a device's observer: its request accounting (observability/request.rs) is still \
         methods of it, not a type of its own",
    ),
    (
        "daemon",
        "Manager",
        "the device manager: resize, restore, replicated volumes and hand-over are still \
         methods of it in files of their own, not types it holds",
    ),
    (
        "target-rdma",
        "ReplicaSet",
        "the replication core's set: rebuild and hand-over are still methods of it in files \
         of their own, not types it holds",
    ),
];

/// Folders (and their subfolders) whose files import no item their
/// folder's `mod.rs` defines.
const VOCABULARY_IN_LEAVES: &[&str] = &[
    "target-rdma/src/store/",
    "target-rdma/src/client/",
    "target-rdma/src/service/",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

const CRATES: &[&str] = &["daemon", "target-rdma", "metrics"];

type ModPath = Vec<String>;

/// Where a module is used from: file and line.
#[derive(Clone, Debug)]
struct Site {
    file: String,
    line: usize,
}

#[derive(Default)]
struct Crate {
    /// Every module: file modules and inline ones.
    modules: BTreeSet<ModPath>,
    /// module -> module it names, with one site each.
    edges: BTreeMap<(ModPath, ModPath), Site>,
    /// Per file: its module path and its non-test line count.
    files: Vec<(String, ModPath, usize)>,
    /// Every path written: file, the module it appears in, the path, its
    /// line, and whether it is a `use` path.
    paths: Vec<(String, ModPath, Vec<String>, usize, bool)>,
    /// Per file: the types it writes an inherent `impl` block for, with
    /// the line of the first one.
    impls: Vec<(String, String, usize)>,
    /// Per file module: the items it defines at its top level (not
    /// modules, not imports).
    defined: BTreeMap<ModPath, BTreeSet<String>>,
}

/// Replaces comments, string and char literals by spaces (newlines kept),
/// so that only code is scanned.
fn strip(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && !b
                .get(i.wrapping_sub(1))
                .is_some_and(|p| p.is_alphanumeric() || *p == '_')
        {
            // Raw string r"..." / r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == '"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            for ch in &b[i..j.min(b.len())] {
                out.push(blank(*ch));
            }
            i = j;
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}'), or a lifetime ('a).
            if next == Some('\\') {
                let mut j = i + 2;
                while j < b.len() && b[j] != '\'' {
                    j += 1;
                }
                for _ in i..=j.min(b.len() - 1) {
                    out.push(' ');
                }
                i = j + 1;
            } else if b.get(i + 2) == Some(&'\'') {
                out.push_str("   ");
                i += 3;
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Sep, // ::
    Punct(char),
}

fn tokens(code: &str) -> Vec<(Tok, usize)> {
    let mut out = Vec::new();
    let mut line = 1;
    let b: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            out.push((Tok::Ident(b[start..i].iter().collect()), line));
        } else if c == ':' && b.get(i + 1) == Some(&':') {
            out.push((Tok::Sep, line));
            i += 2;
        } else {
            out.push((Tok::Punct(c), line));
            i += 1;
        }
    }
    out
}

/// Expands the use tree starting at `toks[*i]` (after `use`) into paths;
/// leaves `*i` after the closing `;`.
fn use_tree(toks: &[(Tok, usize)], i: &mut usize, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let mut path = prefix.to_vec();
    while *i < toks.len() {
        match &toks[*i].0 {
            Tok::Ident(s) if s == "as" => {
                *i += 2; // the alias
            }
            Tok::Ident(s) => {
                path.push(s.clone());
                *i += 1;
            }
            Tok::Sep => *i += 1,
            Tok::Punct('{') => {
                *i += 1;
                loop {
                    use_tree(toks, i, &path, out);
                    match toks.get(*i).map(|t| &t.0) {
                        Some(Tok::Punct(',')) => *i += 1,
                        Some(Tok::Punct('}')) => {
                            *i += 1;
                            break;
                        }
                        _ => break,
                    }
                    if matches!(toks.get(*i).map(|t| &t.0), Some(Tok::Punct('}'))) {
                        *i += 1;
                        break;
                    }
                }
                return;
            }
            Tok::Punct('*') => {
                path.push("*".into());
                *i += 1;
            }
            Tok::Punct(',') | Tok::Punct('}') => {
                out.push(path);
                return;
            }
            Tok::Punct(';') => {
                out.push(path);
                *i += 1;
                return;
            }
            Tok::Punct(_) => *i += 1,
        }
    }
}

impl Crate {
    fn load(dir: &Path) -> Crate {
        let mut c = Crate::default();
        let src = dir.join("src");
        let mut files = Vec::new();
        collect(&src, &mut files);
        for f in &files {
            c.modules.insert(file_module(&src, f));
        }
        for f in &files {
            let rel = f
                .strip_prefix(repo())
                .unwrap_or(f)
                .to_string_lossy()
                .replace("/./", "/");
            let rel = rel.trim_start_matches("./").to_owned();
            let module = file_module(&src, f);
            let text = fs::read_to_string(f).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            // Non-test code ends where an inline `#[cfg(test)] mod .. {` starts.
            let non_test = (0..lines.len())
                .find(|&i| {
                    lines[i].trim() == "#[cfg(test)]"
                        && lines.get(i + 1).is_some_and(|l| {
                            l.trim_start().starts_with("mod ") && l.trim_end().ends_with('{')
                        })
                })
                .unwrap_or(lines.len());
            c.files.push((rel.clone(), module.clone(), non_test));
            c.defined.insert(module.clone(), defined_items(&text));
            for (ty, line) in inherent_impls(&text) {
                c.impls.push((rel.clone(), ty, line));
            }
            c.scan(&rel, &module, &text);
        }
        c
    }

    fn scan(&mut self, file: &str, module: &ModPath, text: &str) {
        let toks = tokens(&strip(text));
        // Inline modules: (path, brace depth at which they close).
        let mut stack: Vec<(ModPath, usize)> = vec![(module.clone(), 0)];
        let mut depth = 0usize;
        let mut paths: Vec<(ModPath, Vec<String>, usize, bool)> = Vec::new();
        let mut i = 0;
        while i < toks.len() {
            let cur = stack.last().unwrap().0.clone();
            match &toks[i].0 {
                Tok::Ident(k) if k == "mod" => {
                    if let (Some((Tok::Ident(name), _)), Some((Tok::Punct('{'), _))) =
                        (toks.get(i + 1), toks.get(i + 2))
                    {
                        let mut p = cur.clone();
                        p.push(name.clone());
                        self.modules.insert(p.clone());
                        depth += 1;
                        stack.push((p, depth));
                        i += 3;
                        continue;
                    }
                    i += 1;
                }
                Tok::Ident(k)
                    if k == "use"
                        && !matches!(toks.get(i.wrapping_sub(1)), Some((Tok::Sep, _))) =>
                {
                    let line = toks[i].1;
                    i += 1;
                    let mut out = Vec::new();
                    use_tree(&toks, &mut i, &[], &mut out);
                    for p in out {
                        paths.push((cur.clone(), p, line, true));
                    }
                }
                Tok::Ident(k)
                    if (k == "crate" || k == "super" || k == "self")
                        && matches!(toks.get(i + 1), Some((Tok::Sep, _)))
                        && !matches!(toks.get(i.wrapping_sub(1)), Some((Tok::Sep, _))) =>
                {
                    let line = toks[i].1;
                    let mut p = vec![k.clone()];
                    let mut j = i + 1;
                    while let (Some((Tok::Sep, _)), Some((Tok::Ident(s), _))) =
                        (toks.get(j), toks.get(j + 1))
                    {
                        p.push(s.clone());
                        j += 2;
                    }
                    paths.push((cur.clone(), p, line, false));
                    i = j;
                }
                Tok::Punct('{') => {
                    depth += 1;
                    i += 1;
                }
                Tok::Punct('}') => {
                    if stack.len() > 1 && stack.last().unwrap().1 == depth {
                        stack.pop();
                    }
                    depth = depth.saturating_sub(1);
                    i += 1;
                }
                _ => i += 1,
            }
        }
        for (from, p, line, in_use) in paths {
            self.paths
                .push((file.to_owned(), from.clone(), p.clone(), line, in_use));
            if let Some(to) = self.resolve(&from, &p, in_use) {
                if to != from {
                    self.edges.entry((from, to)).or_insert(Site {
                        file: file.to_owned(),
                        line,
                    });
                }
            }
        }
    }

    /// The module a path names (its longest module prefix), `None` for
    /// paths outside the crate.
    fn resolve(&self, cur: &ModPath, p: &[String], in_use: bool) -> Option<ModPath> {
        let (mut base, rest) = match p.first().map(String::as_str) {
            Some("crate") => (Vec::new(), &p[1..]),
            Some("self") => (cur.clone(), &p[1..]),
            Some("super") => {
                let mut base = cur.clone();
                let mut k = 0;
                while p.get(k).map(String::as_str) == Some("super") {
                    base.pop();
                    k += 1;
                }
                (base, &p[k..])
            }
            // 2018 paths in `use`: a child module of the current one.
            Some(first) if in_use => {
                let mut child = cur.clone();
                child.push(first.to_owned());
                if !self.modules.contains(&child) {
                    return None;
                }
                (cur.clone(), p)
            }
            _ => return None,
        };
        for seg in rest {
            let mut next = base.clone();
            next.push(seg.clone());
            if self.modules.contains(&next) {
                base = next;
            } else {
                break;
            }
        }
        Some(base)
    }

    /// [`Crate::resolve`], with the first segment after the module: the
    /// item the path names in it (`*` for a glob), if any.
    fn resolve_item(
        &self,
        cur: &ModPath,
        p: &[String],
        in_use: bool,
    ) -> Option<(ModPath, Option<String>)> {
        let to = self.resolve(cur, p, in_use)?;
        // The segments the module took: past the leading `crate`, `self`
        // and `super`s, as many as the module is deeper than that base.
        let lead = p
            .iter()
            .take_while(|s| matches!(s.as_str(), "crate" | "self" | "super"))
            .count();
        let base = match p.first().map(String::as_str) {
            Some("crate") => 0,
            Some("self") => cur.len(),
            Some("super") => cur.len().saturating_sub(lead),
            _ => cur.len(),
        };
        let next = p.get(lead + to.len().saturating_sub(base)).cloned();
        Some((to, next))
    }

    /// Edges lifted to sibling level: parent -> (child a -> child b).
    fn sibling_graphs(&self) -> BTreeMap<ModPath, BTreeMap<(String, String), Site>> {
        let mut graphs: BTreeMap<ModPath, BTreeMap<(String, String), Site>> = BTreeMap::new();
        for ((from, to), site) in &self.edges {
            let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
            if common == from.len() || common == to.len() {
                continue; // ancestor / descendant
            }
            graphs
                .entry(from[..common].to_vec())
                .or_default()
                .entry((from[common].clone(), to[common].clone()))
                .or_insert_with(|| site.clone());
        }
        graphs
    }
}

/// The items a file defines at its top level: functions, types, constants,
/// statics and traits (not modules, not imports).
fn defined_items(text: &str) -> BTreeSet<String> {
    let toks = tokens(&strip(text));
    let mut depth = 0usize;
    let mut out = BTreeSet::new();
    for (i, (t, _)) in toks.iter().enumerate() {
        match t {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth = depth.saturating_sub(1),
            Tok::Ident(k)
                if depth == 0
                    && matches!(
                        k.as_str(),
                        "fn" | "struct" | "enum" | "type" | "const" | "static" | "trait" | "union"
                    ) =>
            {
                if let Some((Tok::Ident(name), _)) = toks.get(i + 1) {
                    out.insert(name.clone());
                }
            }
            _ => {}
        }
    }
    out
}

/// The types a file writes inherent `impl` blocks for (`impl X {`, not
/// `impl T for X {`), each with the line of its first block.
fn inherent_impls(text: &str) -> Vec<(String, usize)> {
    let toks = tokens(&strip(text));
    let mut out: Vec<(String, usize)> = Vec::new();
    for (i, (t, line)) in toks.iter().enumerate() {
        // An item starts a statement; `impl Trait` in a type does not.
        let item = match i.checked_sub(1).map(|p| &toks[p].0) {
            None => true,
            Some(Tok::Punct(c)) => matches!(c, '}' | ';' | ']'),
            Some(Tok::Ident(k)) => k == "unsafe",
            Some(_) => false,
        };
        if *t != Tok::Ident("impl".into()) || !item {
            continue;
        }
        // Skip the impl's own generics, `impl<..>`.
        let mut j = i + 1;
        if toks.get(j).map(|t| &t.0) == Some(&Tok::Punct('<')) {
            let mut angle = 0usize;
            while let Some((t, _)) = toks.get(j) {
                match t {
                    Tok::Punct('<') => angle += 1,
                    Tok::Punct('>') => angle -= 1,
                    _ => {}
                }
                j += 1;
                if angle == 0 {
                    break;
                }
            }
        }
        // The type: the last path segment before its generics, the body
        // or a where clause; a `for` makes it a trait impl.
        let mut ty = None;
        let mut angle = 0usize;
        let mut inherent = true;
        while let Some((t, _)) = toks.get(j) {
            match t {
                Tok::Punct('{') if angle == 0 => break,
                Tok::Punct(';') => {
                    inherent = false;
                    break;
                }
                Tok::Punct('<') => angle += 1,
                Tok::Punct('>') => angle = angle.saturating_sub(1),
                Tok::Ident(k) if k == "for" && angle == 0 => inherent = false,
                Tok::Ident(k) if k == "where" && angle == 0 => break,
                Tok::Ident(k) if angle == 0 => ty = Some(k.clone()),
                _ => {}
            }
            j += 1;
        }
        if let (true, Some(ty)) = (inherent, ty) {
            if !out.iter().any(|(t, _)| *t == ty) {
                out.push((ty, *line));
            }
        }
    }
    out
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "bin") {
                collect(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
}

fn file_module(src: &Path, f: &Path) -> ModPath {
    let rel = f.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap();
    match last.as_str() {
        "lib.rs" | "main.rs" | "mod.rs" => {}
        other => parts.push(other.trim_end_matches(".rs").to_owned()),
    }
    parts
}

/// Strongly connected components with more than one member (Tarjan).
fn cycles(edges: &BTreeMap<(String, String), Site>) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = edges.keys().flat_map(|(a, b)| [a, b]).collect();
    let nodes: Vec<&String> = nodes.into_iter().collect();
    let index_of = |n: &String| nodes.iter().position(|m| *m == n).unwrap();
    let mut adj = vec![Vec::new(); nodes.len()];
    for (a, b) in edges.keys() {
        adj[index_of(a)].push(index_of(b));
    }
    struct St {
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(v: usize, adj: &[Vec<usize>], s: &mut St) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on[v] = true;
        for &w in &adj[v] {
            match s.index[w] {
                None => {
                    visit(w, adj, s);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on[w] => s.low[v] = s.low[v].min(iw),
                _ => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                s.out.push(comp);
            }
        }
    }
    let mut s = St {
        index: vec![None; nodes.len()],
        low: vec![0; nodes.len()],
        on: vec![false; nodes.len()],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..nodes.len() {
        if s.index[v].is_none() {
            visit(v, &adj, &mut s);
        }
    }
    s.out
        .into_iter()
        .map(|c| {
            let mut names: Vec<String> = c.into_iter().map(|i| nodes[i].clone()).collect();
            names.sort();
            names
        })
        .collect()
}

fn show(m: &ModPath) -> String {
    if m.is_empty() {
        "crate".into()
    } else {
        m.join("::")
    }
}

#[test]
fn no_module_imports_a_module_that_imports_it_back() {
    let mut problems = Vec::new();
    for name in CRATES {
        let c = Crate::load(&repo().join(name));
        assert!(c.edges.len() > 10, "{name}: the scan found no imports");
        for (parent, graph) in c.sibling_graphs() {
            for cycle in cycles(&graph) {
                let members: BTreeSet<&String> = cycle.iter().collect();
                let sites: Vec<String> = graph
                    .iter()
                    .filter(|((a, b), _)| members.contains(a) && members.contains(b))
                    .map(|((a, b), s)| format!("    {a} -> {b} ({}:{})", s.file, s.line))
                    .collect();
                problems.push(format!(
                    "{name}: cycle among the children of {}: {}\n{}",
                    show(&parent),
                    cycle.join(", "),
                    sites.join("\n")
                ));
            }
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

/// Which side of target-rdma a top-level module belongs to.
fn side(top: &str) -> &'static str {
    match top {
        "client" | "block" | "replica" => "client",
        "store" | "arenad" => "server",
        // Test support and the fuzz targets' entry points assemble both
        // sides on purpose.
        "testing" | "fuzzing" => "harness",
        _ => "shared",
    }
}

#[test]
fn target_rdma_data_flows_one_way() {
    let c = Crate::load(&repo().join("target-rdma"));
    let mut problems = Vec::new();
    for ((from, to), site) in &c.edges {
        let (Some(a), Some(b)) = (from.first(), to.first()) else {
            continue;
        };
        let (sa, sb) = (side(a), side(b));
        let bad = match sa {
            "client" => sb == "server",
            "server" => sb == "client",
            "shared" => sb == "client" || sb == "server",
            _ => false,
        };
        if bad {
            problems.push(format!(
                "{} ({sa}) names {} ({sb}) at {}:{}",
                show(from),
                show(to),
                site.file,
                site.line
            ));
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn no_source_file_is_longer_than_its_limit() {
    let mut problems = Vec::new();
    for name in CRATES {
        let c = Crate::load(&repo().join(name));
        for (file, _, lines) in &c.files {
            let allowed = LONG_FILES.iter().any(|(f, _)| file.ends_with(f));
            if *lines > MAX_LINES && !allowed && !file.ends_with("/tests.rs") {
                problems.push(format!(
                    "{file}: {lines} lines of non-test code (limit {MAX_LINES})"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn a_types_inherent_impl_lives_in_one_file() {
    let mut problems = Vec::new();
    let mut excepted = Vec::new();
    for name in CRATES {
        let c = Crate::load(&repo().join(name));
        // Types of one name defined in several files are told apart by
        // their definition nearest (by path) to the impl.
        let definers = |ty: &str| -> Vec<&String> {
            c.files
                .iter()
                .filter(|(_, m, _)| c.defined.get(m).is_some_and(|d| d.contains(ty)))
                .map(|(f, _, _)| f)
                .collect()
        };
        let mut by_type: BTreeMap<(&str, String), Vec<String>> = BTreeMap::new();
        for (file, ty, line) in &c.impls {
            let near = |d: &&String| {
                d.chars()
                    .zip(file.chars())
                    .take_while(|(a, b)| a == b)
                    .count()
            };
            let home = definers(ty)
                .into_iter()
                .max_by_key(near)
                .unwrap_or(file)
                .clone();
            by_type
                .entry((ty, home))
                .or_default()
                .push(format!("{file}:{line}"));
        }
        for ((ty, _), sites) in by_type.into_iter().filter(|(_, s)| s.len() > 1) {
            let allowed = SPREAD_IMPLS.iter().any(|(k, t, _)| k == name && *t == ty);
            let what = format!("{name}: impl {ty} is written in {}", sites.join(", "));
            if allowed {
                excepted.push(what);
            } else {
                problems.push(what);
            }
        }
    }
    // An exception that no longer applies is dropped from the list.
    for (k, t, _) in SPREAD_IMPLS {
        assert!(
            excepted
                .iter()
                .any(|e| e.starts_with(&format!("{k}: impl {t} "))),
            "{k}: impl {t} is in one file now: drop it from SPREAD_IMPLS"
        );
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn no_file_imports_an_item_its_folders_mod_rs_defines() {
    let c = Crate::load(&repo().join("target-rdma"));
    let module_of: BTreeMap<&str, &ModPath> =
        c.files.iter().map(|(f, m, _)| (f.as_str(), m)).collect();
    let mut problems = Vec::new();
    let mut checked = 0;
    for (file, cur, p, line, in_use) in &c.paths {
        let ruled = VOCABULARY_IN_LEAVES.iter().any(|d| file.starts_with(d));
        if !ruled || file.ends_with("/mod.rs") {
            continue;
        }
        let Some(own) = module_of.get(file.as_str()) else {
            continue;
        };
        let folder = &own[..own.len() - 1];
        checked += 1;
        let Some((to, Some(item))) = c.resolve_item(cur, p, *in_use) else {
            continue;
        };
        if to != folder {
            continue;
        }
        let defined = c.defined.get(&to).cloned().unwrap_or_default();
        let bad = if item == "*" {
            !defined.is_empty()
        } else {
            defined.contains(&item)
        };
        if bad {
            problems.push(format!(
                "{file}:{line}: imports {} from {}'s mod.rs, which defines it: move it to a leaf file",
                p.join("::"),
                show(&to)
            ));
        }
    }
    assert!(checked > 50, "the scan found no paths in the ruled folders");
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn the_rule_scanners_find_definitions_impls_and_items() {
    let text = "pub struct A; impl A { fn f() {} } impl<T> B<T> where T: C { }\n\
                impl fmt::Display for A {} impl crate::x::D {} const K: u8 = 1;\n\
                mod m { fn hidden() {} }";
    assert_eq!(
        inherent_impls(text),
        vec![("A".to_owned(), 1), ("B".into(), 1), ("D".into(), 2)]
    );
    let defined = defined_items(text);
    assert!(defined.contains("A") && defined.contains("K") && !defined.contains("hidden"));
    let mut c = Crate::default();
    for m in [vec![], vec!["a".to_owned()], vec!["a".into(), "b".into()]] {
        c.modules.insert(m);
    }
    let cur: ModPath = vec!["a".into(), "b".into()];
    let path = |s: &str| s.split("::").map(str::to_owned).collect::<Vec<_>>();
    assert_eq!(
        c.resolve_item(&cur, &path("super::X"), true),
        Some((vec!["a".to_owned()], Some("X".to_owned())))
    );
    assert_eq!(
        c.resolve_item(&cur, &path("crate::a::b::Y::new"), false),
        Some((cur.clone(), Some("Y".to_owned())))
    );
    assert_eq!(
        c.resolve_item(&cur, &path("super::*"), true),
        Some((vec!["a".to_owned()], Some("*".to_owned())))
    );
}

#[test]
fn the_scanner_resolves_use_trees_and_inline_paths() {
    let code = strip(
        "use crate::{a::{B, c::D}, e as f}; // crate::x::y\nlet s = \"crate::z\"; super::g::h();",
    );
    let toks = tokens(&code);
    let mut i = 1;
    let mut out = Vec::new();
    use_tree(&toks, &mut i, &[], &mut out);
    assert_eq!(
        out,
        vec![
            vec!["crate", "a", "B"],
            vec!["crate", "a", "c", "D"],
            vec!["crate", "e"],
        ]
    );
    assert!(!code.contains("crate::x") && !code.contains("crate::z"));
    let mut c = Crate::default();
    for m in [vec![], vec!["a".to_owned()], vec!["a".into(), "c".into()]] {
        c.modules.insert(m);
    }
    let g = vec!["g".to_owned()];
    c.modules.insert(g.clone());
    assert_eq!(
        c.resolve(
            &vec!["a".into(), "c".into()],
            &["super".into(), "super".into(), "g".into(), "h".into()],
            false
        ),
        Some(g)
    );
}

#[test]
fn a_cycle_among_siblings_is_found_and_a_chain_is_not() {
    let site = || Site {
        file: "f.rs".into(),
        line: 1,
    };
    let edge = |a: &str, b: &str| ((a.to_owned(), b.to_owned()), site());
    let chain: BTreeMap<_, _> = [edge("a", "b"), edge("b", "c"), edge("a", "c")].into();
    assert!(cycles(&chain).is_empty());
    let looped: BTreeMap<_, _> = [
        edge("a", "b"),
        edge("b", "c"),
        edge("c", "a"),
        edge("d", "a"),
    ]
    .into();
    assert_eq!(cycles(&looped), vec![vec!["a", "b", "c"]]);
}

/// Every `.rs` file under `dir`, binaries included.
fn all_sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            all_sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Lines (1-based) of `text` where a field `event` is given a string
/// literal.
fn event_literals(text: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(i) = rest.find("event") {
            let before = rest[..i].chars().next_back();
            let after = rest[i + "event".len()..].trim_start();
            let word_start = !before.is_some_and(|c| c.is_alphanumeric() || c == '_');
            if word_start {
                if let Some(value) = after.strip_prefix('=') {
                    if !value.starts_with(['=', '>']) && value.trim_start().starts_with('"') {
                        out.push(n + 1);
                        break;
                    }
                }
            }
            rest = &rest[i + "event".len()..];
        }
    }
    out
}

#[test]
fn event_names_are_constants_not_literals() {
    let mut problems = Vec::new();
    let mut files = 0;
    for name in CRATES {
        let mut sources = Vec::new();
        all_sources(&repo().join(name).join("src"), &mut sources);
        for f in sources {
            files += 1;
            let text = fs::read_to_string(&f).unwrap();
            for line in event_literals(&text) {
                problems.push(format!(
                    "{}:{line}: an event name written as a literal; use its constant",
                    f.strip_prefix(repo()).unwrap_or(&f).display()
                ));
            }
        }
    }
    assert!(files > 100, "only {files} source files");
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn the_event_literal_scan_finds_literals_only() {
    let text = "info!(event = \"a.b\", x);\n\
                warn!(event = events::A_B);\n\
                let prevent = \"x\";\n\
                if event == \"a\" {}\n\
                debug!(x = 1,\n    event  =  \"c.d\");\n";
    assert_eq!(event_literals(text), vec![1, 6]);
}
