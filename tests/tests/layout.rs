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
//!   (the wire codec excepted: one table of frames reads best in one file).
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
        // Test support assembles both sides on purpose.
        "testing" => "harness",
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
