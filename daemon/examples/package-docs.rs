//! Writes the man pages and shell completions of `ublkd`, `ublkctl` and
//! `arenad` from their clap definitions, for the .deb packages
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

use std::fs::{create_dir_all, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use clap::{Command, CommandFactory};
use clap_complete::Shell;

fn commands() -> [Command; 3] {
    [
        ublkd_bin::Args::command().name("ublkd"),
        ublkctl_bin::Cli::command().name("ublkctl"),
        arenad_bin::Args::command().name("arenad"),
    ]
}

fn create(path: &Path) -> std::io::Result<BufWriter<File>> {
    File::create(path).map(BufWriter::new)
}

fn man_page(dir: &Path, cmd: Command) -> std::io::Result<()> {
    let man = clap_mangen::Man::new(cmd)
        .section("8")
        .manual("ublk-arena")
        .source(format!("ublk-arena {}", env!("CARGO_PKG_VERSION")));
    let mut out = create(&dir.join(man.get_filename()))?;
    man.render(&mut out)?;
    out.flush()
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
        // Propagates global options into the subcommands' pages.
        cmd.build();
        let name = cmd.get_name().to_string();
        man_page(&man, cmd.clone())?;
        for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
            let page = format!("{name}-{}", sub.get_name());
            man_page(
                &man,
                sub.clone()
                    .display_name(&page)
                    .bin_name(format!("{name} {}", sub.get_name())),
            )?;
        }
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
