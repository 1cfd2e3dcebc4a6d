//! Puts the git revision of the build into `UBLK_GIT_REVISION` for the
//! `*_build_info{revision}` metric: `UBLK_GIT_REVISION` from the
//! environment when set (packagers building from a tarball), else
//! `git rev-parse` of the checkout, else `unknown` (a source tree without
//! `.git`, or no git installed).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_owned())
}

fn main() {
    println!("cargo:rerun-if-env-changed=UBLK_GIT_REVISION");
    println!("cargo:rerun-if-changed=build.rs");
    let revision = match std::env::var("UBLK_GIT_REVISION") {
        Ok(r) if !r.is_empty() => r,
        _ => {
            // HEAD moves on checkout; logs/HEAD on every commit too.
            for path in ["HEAD", "logs/HEAD"] {
                if let Some(p) = git(&["rev-parse", "--git-path", path]) {
                    if std::path::Path::new(&p).exists() {
                        println!("cargo:rerun-if-changed={p}");
                    }
                }
            }
            git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into())
        }
    };
    // Label-safe: hex digits, or what a packager set, kept to [A-Za-z0-9._-].
    let safe: String = revision
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        .take(40)
        .collect();
    println!("cargo:rustc-env=UBLK_GIT_REVISION={safe}");
}
