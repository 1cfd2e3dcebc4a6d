//! Writes the man pages and shell completions of `ublkd`, `ublkctl`,
//! `arenad` and `arenactl` from their clap definitions, for the .deb packages
//! (scripts/package):
//!
//!     cargo run -p ublkd --example package-docs -- OUT_DIR
//!
//! writes `OUT_DIR/man8/*.8` (one page per command and per `ublkctl`
//! subcommand) and `OUT_DIR/completions/{bash,zsh,fish}/`. The daemons'
//! argument structs are compiled in from the binaries' own sources, so a
//! page cannot describe another CLI than the one the binary parses.

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
                ".TP\n\\fI/etc/ublkd/ublkd.toml\\fR\nThe configuration (\\fB--config\\fR).\n\
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
                "\\fBublkctl\\fR(8), \\fBarenad\\fR(8); /usr/share/doc/ublkd/OPERATIONS.md",
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
                ".TP\n\\fI/etc/arenad/arenad.toml\\fR\nThe configuration (\\fB--config\\fR).\n\
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
                "\\fBarenactl\\fR(8), \\fBublkd\\fR(8), \\fBublkctl\\fR(8); \
                 /usr/share/doc/arenad/OPERATIONS.md",
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
