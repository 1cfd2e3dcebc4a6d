//! Writes the man pages and shell completions of `ublkd`, `ublkctl`,
//! `arenad` and `arenactl` from their clap definitions, for the .deb packages
//! (scripts/package):
//!
//!     cargo run -p ublkd --example package-docs -- OUT_DIR
//!
//! writes `OUT_DIR/man8/*.8` (one page per command and per `ublkctl`
//! subcommand), `OUT_DIR/man5/{arenad,ublkd}.toml.5` (the config files) and
//! `OUT_DIR/completions/{bash,zsh,fish}/`. The daemons' argument structs
//! are compiled in from the binaries' own sources, so a page cannot
//! describe another CLI than the one the binary parses; the config pages
//! are rendered from the key tables next to the configs
//! (`arenad::config_doc`, `ublkd::config_doc`), whose keys, defaults and
//! reload behaviour come from the configs' code.

#[allow(dead_code)]
#[path = "../src/bin/ublkd.rs"]
mod ublkd_bin;

#[allow(dead_code)]
#[path = "../src/bin/ublkctl.rs"]
mod ublkctl_bin;

#[allow(dead_code)]
#[path = "../../target-rdma/src/bin/arenad.rs"]
mod arenad_bin;

#[allow(dead_code)]
#[path = "../../target-rdma/src/bin/arenactl.rs"]
mod arenactl_bin;

use std::fs::{create_dir_all, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use clap::{Command, CommandFactory};
use clap_complete::Shell;
use target_rdma::service::config_doc::{Entry, Reload};

fn commands() -> [Command; 4] {
    [
        ublkd_bin::Args::command().name("ublkd"),
        ublkctl_bin::Cli::command().name("ublkctl"),
        arenad_bin::Args::command().name("arenad"),
        arenactl_bin::Cli::command().name("arenactl"),
    ]
}

fn create(path: &Path) -> std::io::Result<BufWriter<File>> {
    File::create(path).map(BufWriter::new)
}

/// The sections of a command's page that its arguments do not give:
/// (heading, roff body). Facts from docs/OPERATIONS.md.
fn sections(name: &str) -> &'static [(&'static str, &'static str)] {
    match name {
        "ublkd" => &[
            (
                "EXIT STATUS",
                "0 after a stop by SIGTERM or SIGINT, or when \\fB--check-config\\fR finds \
                 no problem; 1 when the start is refused or \\fB--check-config\\fR finds a \
                 problem (the reason on stderr); 2 for a usage error.",
            ),
            (
                "SIGNALS",
                ".TP\n\\fBSIGHUP\\fR\nRe-reads the configuration and applies what it can \
                 without a restart (\\fBublkctl reload\\fR does the same and reports the \
                 outcome).\n.TP\n\\fBSIGTERM\\fR, \\fBSIGINT\\fR\nStops: with \
                 \\fIon_shutdown = \"keep\"\\fR every device's arena session is flushed and \
                 the devices stay in the kernel for the next ublkd to recover; with \
                 \\fI\"remove\"\\fR they are deleted.",
            ),
            (
                "FILES",
                ".TP\n\\fI/etc/ublkd/ublkd.toml\\fR\nThe configuration (\\fB--config\\fR); \
                 \\fBublkd.toml\\fR(5) describes every key.\n\
                 .TP\n\\fI/var/lib/ublkd/devices/\\fR\nOne definition per device \
                 (\\fIstate_dir\\fR), brought back at start.\n.TP\n\
                 \\fI/run/ublkd/ublkd.sock\\fR\nThe control socket \\fBublkctl\\fR talks to \
                 (\\fIsocket\\fR).",
            ),
            (
                "EXAMPLES",
                "Check a configuration without starting:\n.PP\n.nf\n\
                 ublkd --config /etc/ublkd/ublkd.toml --check-config\n.fi\n.PP\n\
                 Run as the packaged unit does:\n.PP\n.nf\nsystemctl enable --now ublkd\n.fi",
            ),
            (
                "SEE ALSO",
                "\\fBublkd.toml\\fR(5), \\fBublkctl\\fR(8), \\fBarenad\\fR(8);\n.br\n\
                 \\%/usr/share/doc/ublkd/OPERATIONS.md",
            ),
        ],
        "arenad" => &[
            (
                "EXIT STATUS",
                "0 after a stop by SIGTERM or SIGINT (the store flushed), when \\fB--check\\fR \
                 finds no problem, or when \\fB--repair\\fR lost nothing; 1 when the start is \
                 refused, \\fB--check\\fR finds a problem or \\fB--repair\\fR fails (the \
                 reason on stderr); 2 when \\fB--repair\\fR reports losses, or for a usage \
                 error.",
            ),
            (
                "SIGNALS",
                ".TP\n\\fBSIGHUP\\fR\nRe-reads the configuration and the command line: \
                 volumes added, removed and re-keyed, the log level; the outcome is logged \
                 (\\fIconfig.reloaded\\fR or \\fIconfig.reload_failed\\fR); \
                 \\fBarenactl reload\\fR does the same and reports the outcome.\n.TP\n\
                 \\fBSIGTERM\\fR, \\fBSIGINT\\fR\nStops accepting, lets the requests \
                 already read finish (up to \\fIshutdown_timeout_secs\\fR), flushes the \
                 store and exits.",
            ),
            (
                "FILES",
                ".TP\n\\fI/etc/arenad/arenad.toml\\fR\nThe configuration (\\fB--config\\fR); \
                 \\fBarenad.toml\\fR(5) describes every key.\n\
                 .TP\n\\fIswap_dir\\fR (\\fI/var/lib/arenad\\fR)\nThe store: \
                 \\fIswap.dat\\fR (the extents), \\fIswap.meta\\fR (their headers), \
                 \\fIindex.ckpt\\fR and \\fIindex.journal\\fR (the index), \\fIepochs\\fR \
                 (the volumes' membership epochs), \\fIlock\\fR.\n.TP\n\
                 \\fI/run/arenad/admin.sock\\fR\nThe admin socket \\fBarenactl\\fR talks to \
                 (\\fIadmin_socket\\fR).",
            ),
            (
                "EXAMPLES",
                "Check a configuration and the store without starting:\n.PP\n.nf\n\
                 arenad --config /etc/arenad/arenad.toml --check\n.fi\n.PP\n\
                 Rebuild a damaged index from the extent headers (arenad stopped):\n.PP\n.nf\n\
                 arenad --config /etc/arenad/arenad.toml --repair\n.fi",
            ),
            (
                "SEE ALSO",
                "\\fBarenad.toml\\fR(5), \\fBarenactl\\fR(8), \\fBublkd\\fR(8), \\fBublkctl\\fR(8);\n.br\n\
                 \\%/usr/share/doc/arenad/OPERATIONS.md",
            ),
        ],
        "arenactl" => &[
            (
                "EXIT STATUS",
                "0 on success; 1 when the request fails or arenad refuses it (the reason \
                 on stderr; with \\fB--json\\fR also one line \
                 {\"error\":{\"kind\":...,\"message\":...}} on stdout), among them a \
                 \\fBreload\\fR or \\fBcheck\\fR of a configuration arenad does not \
                 accept; 2 for a usage error.",
            ),
            (
                "ENVIRONMENT",
                ".TP\n\\fBARENACTL_SOCKET\\fR\nThe admin socket, when \\fB--socket\\fR is \
                 not given.",
            ),
            (
                "FILES",
                ".TP\n\\fI/etc/arenad/arenad.toml\\fR\nWhere the socket is found (its \
                 \\fIadmin_socket\\fR key) when neither \\fB--socket\\fR nor \
                 \\fBARENACTL_SOCKET\\fR is given.\n.TP\n\\fI/run/arenad/admin.sock\\fR\n\
                 The default socket.",
            ),
            (
                "EXAMPLES",
                "Which hosts hold sessions on volume vm1, and end one host's:\n.PP\n.nf\n\
                 arenactl sessions --volume vm1\narenactl disconnect --peer 10.0.0.7\n.fi\n.PP\n\
                 Apply a changed configuration, failing on a bad one:\n.PP\n.nf\n\
                 arenactl check && arenactl reload\n.fi",
            ),
            ("SEE ALSO", "\\fBarenad\\fR(8), \\fBublkctl\\fR(8)"),
        ],
        "ublkctl" => &[
            (
                "EXIT STATUS",
                "0 on success; 1 when the request fails (the reason on stderr; with \
                 \\fB--json\\fR also one line {\"error\":{\"kind\":...,\"message\":...}} on \
                 stdout); 2 for a usage error.",
            ),
            (
                "ENVIRONMENT",
                ".TP\n\\fBUBLKCTL_SOCKET\\fR\nThe control socket, when \\fB--socket\\fR is not \
                 given.",
            ),
            (
                "FILES",
                ".TP\n\\fI/etc/ublkd/ublkd.toml\\fR\nWhere the socket is found (its \
                 \\fIsocket\\fR key) when neither \\fB--socket\\fR nor \
                 \\fBUBLKCTL_SOCKET\\fR is given.\n.TP\n\\fI/run/ublkd/ublkd.sock\\fR\n\
                 The default socket.",
            ),
            (
                "EXAMPLES",
                "A device on an arena peer, and its state:\n.PP\n.nf\n\
                 ublkctl add --peer 10.0.0.5:7070 --volume vm1 --secret-file /etc/ublkd/vm1.key \\\\\n\
                 \\ \\ \\ \\ --size 10G\nublkctl list\n.fi",
            ),
            ("SEE ALSO", "\\fBublkd\\fR(8), \\fBarenad\\fR(8)"),
        ],
        _ => &[],
    }
}

/// A config file's page (section 5): the prose around its keys. The keys
/// come from the config's key table (`entries`).
struct ConfigPage {
    /// `arenad.toml`.
    name: &'static str,
    /// The NAME line's summary.
    summary: &'static str,
    /// Where the packaged daemon reads it.
    path: &'static str,
    /// DESCRIPTION, roff.
    description: &'static str,
    /// The tables, in page order: (header as written in the file, `[t]`
    /// or `[[t]]`; roff introduction). A key `t.k` is listed under table
    /// `t`, which must be here; keys without a dot come first.
    tables: &'static [(&'static str, &'static str)],
    /// FILES, roff.
    files: &'static str,
    /// SEE ALSO, roff.
    see_also: &'static str,
}

const RELOAD_TEXT: &str =
    "A key whose change is \\fIapplied by a reload\\fR is put in force by \\fBsystemctl \
    reload\\fR (SIGHUP) while the daemon runs; a change of any other key is logged as \
    \\fIconfig.restart_needed\\fR and takes effect at the next \\fBsystemctl restart\\fR. \
    A file that does not parse or validate changes nothing: the running configuration stays.";

const SIZE_TEXT: &str = "A \\fIsize\\fR is a number of bytes or a string with a binary unit \
    (K = 1024): \\fB4096\\fR, \\fB\"512K\"\\fR, \\fB\"1M\"\\fR, \\fB\"64G\"\\fR.";

fn config_pages() -> [ConfigPage; 2] {
    [
        ConfigPage {
            name: "arenad.toml",
            summary: "configuration of arenad, the remote RAM arena peer",
            path: "/etc/arenad/arenad.toml",
            description: "\\fBarenad\\fR(8) reads its configuration from a TOML file: flat keys, \
                 then one \\fB[[volume]]\\fR table per volume it serves. Every flat key has a \
                 default; a volume's keys do not, and at least one volume is required (from \
                 the file or \\fB\\-\\-volume\\fR). An unknown key, a value of the wrong type \
                 or out of range stops arenad at start with a message naming the key; \
                 \\fBarenad \\-\\-check\\fR runs the checks of a start and prints the effective \
                 configuration. Command-line flags override the keys they name.",
            tables: &[(
                "[[volume]]",
                "One table per volume served: clients open it by name and prove its secret. \
                 A reload serves a volume added, refuses a removed one to new sessions (its \
                 blobs stay), applies a changed quota to new blobs and reads every secret \
                 file again.",
            )],
            files: ".TP\n\\fI/etc/arenad/arenad.toml\\fR\nThe configuration (\\fBarenad \
                 \\-\\-config\\fR); the packaged one sets the defaults and one example volume.\n\
                 .TP\n\\fI/var/lib/arenad\\fR\nThe store (\\fIswap_dir\\fR).\n.TP\n\
                 \\fI/run/arenad/admin.sock\\fR\nThe admin socket (\\fIadmin_socket\\fR).",
            see_also: "\\fBarenad\\fR(8), \\fBarenactl\\fR(8), \\fBublkd.toml\\fR(5); \
                 \\%/usr/share/doc/arenad/OPERATIONS.md",
        },
        ConfigPage {
            name: "ublkd.toml",
            summary: "configuration of ublkd, the ublk block device daemon",
            path: "/etc/ublkd/ublkd.toml",
            description: "\\fBublkd\\fR(8) reads its configuration from a TOML file: keys \
                 outside any table, then the tables below. Every key is optional but those \
                 marked required within a table that is present. An unknown key, a value of \
                 the wrong type or out of range stops ublkd at start with a message naming \
                 the key; \\fBublkd \\-\\-check\\-config\\fR runs the checks and prints the \
                 effective configuration.",
            tables: &[
                (
                    "[device]",
                    "Parameters of new devices. \\fBublkctl add\\fR overrides \\fIqueues\\fR, \
                     \\fIdepth\\fR, \\fIio_buf\\fR, \\fIblob_size\\fR and \\fItransport\\fR per \
                     device, and \\fB\\-\\-confidential\\fR turns \\fIconfidential\\fR on for one; \
                     existing devices keep the parameters recorded in their definition.",
                ),
                (
                    "[metrics]",
                    "The metrics and health listener, and the request trackers.",
                ),
                (
                    "[rdma]",
                    "The local RDMA device of \\fBrdma\\fR and \\fBauto\\fR devices.",
                ),
                (
                    "[etcd]",
                    "The coordination service of replicated volumes. Without this table ublkd \
                     coordinates alone: memberships in the state directory, one host only.",
                ),
                (
                    "[replication]",
                    "How replicated devices wait, hedge and rebuild.",
                ),
                ("[tracing]", "Sampled spans of block requests."),
            ],
            files: ".TP\n\\fI/etc/ublkd/ublkd.toml\\fR\nThe configuration (\\fBublkd \
                 \\-\\-config\\fR); \\fBublkctl\\fR reads its \\fIsocket\\fR key.\n.TP\n\
                 \\fI/var/lib/ublkd/devices/\\fR\nOne definition per device (\\fIstate_dir\\fR).\n\
                 .TP\n\\fI/run/ublkd/ublkd.sock\\fR\nThe control socket (\\fIsocket\\fR).",
            see_also: "\\fBublkd\\fR(8), \\fBublkctl\\fR(8), \\fBarenad.toml\\fR(5); \
                 \\%/usr/share/doc/ublkd/OPERATIONS.md, \\%/usr/share/doc/ublkd/REPLICATION.md",
        },
    ]
}

/// Operator prose as roff: `` `x` `` in bold, backslashes and hyphens
/// escaped, no line taken for a request.
fn roff(text: &str) -> String {
    let escaped = text.replace('\\', "\\e").replace('-', "\\-");
    let mut out = String::new();
    for (i, part) in escaped.split('`').enumerate() {
        if i % 2 == 1 {
            out.push_str(&format!("\\fB{part}\\fR"));
        } else {
            out.push_str(part);
        }
    }
    if out.starts_with('.') || out.starts_with('\'') {
        out.insert_str(0, "\\&");
    }
    out
}

fn config_page(dir: &Path, page: &ConfigPage, entries: &[Entry]) -> std::io::Result<()> {
    fn table_of(key: &str) -> Option<&str> {
        key.split_once('.').map(|(t, _)| t)
    }
    for e in entries {
        if let Some(t) = table_of(e.key) {
            let header = |name: &&str| name.trim_matches(|c| c == '[' || c == ']') == t;
            if !page.tables.iter().any(|(name, _)| header(name)) {
                return Err(std::io::Error::other(format!(
                    "{}: key {} is in table [{t}], which the page does not introduce",
                    page.name, e.key
                )));
            }
        }
    }
    let mut out = create(&dir.join(format!("{}.5", page.name)))?;
    writeln!(
        out,
        ".TH {} 5 \"\" \"ublk-arena {}\" ublk-arena\n.nh\n.ad l",
        page.name,
        env!("CARGO_PKG_VERSION")
    )?;
    writeln!(out, ".SH NAME\n{} \\- {}", page.name, page.summary)?;
    writeln!(out, ".SH SYNOPSIS\n\\fI{}\\fR", page.path)?;
    writeln!(
        out,
        ".SH DESCRIPTION\n{}\n.PP\n{RELOAD_TEXT}\n.PP\n{SIZE_TEXT}",
        page.description
    )?;
    writeln!(out, ".SH KEYS")?;
    let mut groups: Vec<(Option<&str>, &str)> = vec![(None, "")];
    groups.extend(page.tables.iter().map(|(t, intro)| (Some(*t), *intro)));
    for (table, intro) in groups {
        if let Some(t) = table {
            writeln!(out, ".SS \"{t}\"\n{intro}")?;
        }
        let table = table.map(|t| t.trim_matches(|c| c == '[' || c == ']'));
        for e in entries.iter().filter(|e| table_of(e.key) == table) {
            let short = e.key.rsplit('.').next().unwrap_or(e.key);
            let default = match e.default.as_str() {
                "required" => "Required.".to_string(),
                "unset" => "Default: unset.".to_string(),
                d => format!("Default: \\fB{}\\fR.", roff(d)),
            };
            let reload = match e.reload {
                Reload::Applied => "A change is applied by a \\fIreload\\fR.",
                Reload::Restart => "A change needs a restart.",
            };
            writeln!(
                out,
                ".TP\n\\fB{}\\fR (\\fI{}\\fR)\n{}\n.br\n{default} {reload}",
                roff(short),
                roff(&e.ty),
                roff(e.meaning)
            )?;
        }
    }
    writeln!(out, ".SH FILES\n{}", page.files)?;
    writeln!(out, ".SH \"SEE ALSO\"\n{}", page.see_also)?;
    out.flush()
}

fn man_page(dir: &Path, cmd: Command) -> std::io::Result<()> {
    let extra = sections(cmd.get_name());
    let man = clap_mangen::Man::new(cmd.clone())
        .section("8")
        .manual("ublk-arena")
        .source(format!("ublk-arena {}", env!("CARGO_PKG_VERSION")));
    let mut out = create(&dir.join(man.get_filename()))?;
    if extra.is_empty() {
        man.render(&mut out)?;
        return out.flush();
    }
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    man.render_options_section(&mut out)?;
    if cmd.get_subcommands().next().is_some() {
        man.render_subcommands_section(&mut out)?;
    }
    for (heading, body) in extra {
        writeln!(out, ".SH \"{heading}\"\n{body}")?;
    }
    man.render_version_section(&mut out)?;
    out.flush()
}

/// `cmd` with no `help` subcommand at any depth.
fn without_help(mut cmd: Command) -> Command {
    let names: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_owned())
        .collect();
    for n in names {
        cmd = cmd.mut_subcommand(n, without_help);
    }
    cmd.disable_help_subcommand(true)
}

/// The page of `cmd` (named `page`, run as `bin`) and of each of its
/// subcommands, at any depth: a page that lists a subcommand has it.
fn man_pages(dir: &Path, cmd: &Command, page: &str, bin: &str) -> std::io::Result<()> {
    man_page(dir, cmd.clone().display_name(page).bin_name(bin))?;
    for sub in cmd.get_subcommands() {
        let name = sub.get_name();
        man_pages(
            dir,
            sub,
            &format!("{page}-{name}"),
            &format!("{bin} {name}"),
        )?;
    }
    Ok(())
}

fn main() -> std::io::Result<()> {
    let out = PathBuf::from(
        std::env::args_os()
            .nth(1)
            .expect("usage: package-docs OUT_DIR"),
    );
    let man = out.join("man8");
    create_dir_all(&man)?;
    let man5 = out.join("man5");
    create_dir_all(&man5)?;
    let [arenad_page, ublkd_page] = config_pages();
    for (page, entries) in [
        (arenad_page, target_rdma::arenad::config_doc::entries()),
        (ublkd_page, ublkd::config_doc::entries()),
    ] {
        let entries = entries.map_err(|e| std::io::Error::other(format!("{}: {e}", page.name)))?;
        config_page(&man5, &page, &entries)?;
    }
    for mut cmd in commands() {
        // The pages list no `help` subcommand (none is shipped as a page);
        // the completions still offer it. Building propagates global
        // options into the subcommands' pages.
        let mut page = without_help(cmd.clone());
        page.build();
        cmd.build();
        let name = cmd.get_name().to_string();
        man_pages(&man, &page, &name, &name)?;
        for (shell, file) in [
            (Shell::Bash, name.clone()),
            (Shell::Zsh, format!("_{name}")),
            (Shell::Fish, format!("{name}.fish")),
        ] {
            let dir = out.join("completions").join(shell.to_string());
            create_dir_all(&dir)?;
            let mut w = create(&dir.join(file))?;
            clap_complete::generate(shell, &mut cmd.clone(), &name, &mut w);
            w.flush()?;
        }
    }
    Ok(())
}
