//! `arenactl`: look into and operate a running `arenad` over its admin
//! socket: its volumes, the sessions on them, ending sessions, and a
//! reload that reports its outcome.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args as ClapArgs, Parser, Subcommand};
use target_rdma::admin::{
    self, DisconnectTarget, ErrorKind, Reply, Request, Response, SessionInfo, VolumeInfo,
};
use target_rdma::arenad::config::DEFAULT_CONFIG_PATH;
use target_rdma::service::config_file::Change;
use target_rdma::service::local_socket;
use target_rdma::service::size::{ApproxSize, HumanSize};

/// Look into and operate a running arenad.
#[derive(Parser, Debug)]
#[command(name = "arenactl", version)]
pub(crate) struct Cli {
    /// arenad's admin socket [default: $ARENACTL_SOCKET, else the
    /// `admin_socket` of arenad's config, else /run/arenad/admin.sock].
    #[arg(long, global = true)]
    socket: Option<PathBuf>,
    /// arenad's config, read for its `admin_socket` when neither --socket
    /// nor $ARENACTL_SOCKET is given.
    #[arg(long, global = true, default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// Seconds to wait for an answer.
    #[arg(long, global = true, default_value_t = 30)]
    timeout: u64,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Every volume: quota, blobs in RAM / on swap / in all, leases,
    /// sessions and writer epoch.
    Volumes(Plain),
    /// The authenticated sessions: peer, volume, transport, leases held,
    /// age and traffic.
    Sessions(Sessions),
    /// End sessions now: one by id, every session of a volume, or every
    /// session from an address. Their leases end with them; a client
    /// reconnects as after any lost connection.
    Disconnect(Disconnect),
    /// Make arenad re-read its configuration and apply what can change
    /// while it runs (as SIGHUP does); prints what changed. Exits 1, with
    /// the reason, when the file or a secret does not load: arenad keeps
    /// its running configuration. The unit's ExecReload runs it, so
    /// `systemctl reload arenad` fails on a bad file.
    Reload(Plain),
    /// Read the configuration as a reload would and print what it would
    /// change, changing nothing; exits 1 when a reload would fail.
    Check(Plain),
    /// The store's and the server's counters (what /diagnostics shows).
    Stats(Plain),
}

/// A subcommand with no arguments of its own.
#[derive(ClapArgs, Debug)]
struct Plain {}

#[derive(ClapArgs, Debug)]
struct Sessions {
    /// Only this volume's sessions.
    #[arg(long)]
    volume: Option<String>,
}

#[derive(ClapArgs, Debug)]
#[group(required = true, multiple = false)]
struct Disconnect {
    /// The session's id (the first column of `arenactl sessions`).
    session: Option<u64>,
    /// Every session of this volume.
    #[arg(long)]
    volume: Option<String>,
    /// Every session from this IP address, or the one from IP:port.
    #[arg(long)]
    peer: Option<String>,
}

/// arenad's refusal of a request, kept typed so that `--json` prints its
/// class.
#[derive(Debug)]
struct Refused {
    kind: ErrorKind,
    message: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Refused {}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let message = target_rdma::service::error_chain::one_line(e.chain());
            if cli.json {
                let error = match e.downcast_ref::<Refused>() {
                    Some(r) => serde_json::json!({"kind": r.kind, "message": r.message}),
                    None => serde_json::json!({"kind": "client", "message": message}),
                };
                println!("{}", serde_json::json!({ "error": error }));
            }
            eprintln!("arenactl: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The admin socket: --socket, else $ARENACTL_SOCKET, else the
/// `admin_socket` of arenad's config when that file sets it, else the
/// packaged default. Only that key is read: `arenactl reload` of a broken
/// file must reach arenad, which names what is wrong.
fn socket(cli: &Cli) -> anyhow::Result<PathBuf> {
    if let Some(s) = &cli.socket {
        return Ok(s.clone());
    }
    if let Some(s) = std::env::var_os("ARENACTL_SOCKET") {
        return Ok(s.into());
    }
    let set = local_socket::configured_socket(&cli.config, "admin_socket").with_context(|| {
        format!(
            "reading {} to find the admin socket (pass --socket to skip the config)",
            cli.config.display()
        )
    })?;
    match set.as_deref() {
        None => Ok(admin::DEFAULT_SOCKET.into()),
        Some("" | "off") => anyhow::bail!(
            "{} sets admin_socket = \"off\": this arenad has no admin socket",
            cli.config.display()
        ),
        Some(path) => Ok(path.into()),
    }
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let request = match &cli.cmd {
        Cmd::Volumes(_) => Request::Volumes,
        Cmd::Sessions(s) => Request::Sessions {
            volume: s.volume.clone(),
        },
        Cmd::Disconnect(d) => Request::Disconnect {
            target: match (d.session, &d.volume, &d.peer) {
                (Some(id), _, _) => DisconnectTarget::Session(id),
                (_, Some(v), _) => DisconnectTarget::Volume(v.clone()),
                (_, _, Some(p)) => DisconnectTarget::Peer(p.clone()),
                (None, None, None) => unreachable!("clap requires one"),
            },
        },
        Cmd::Reload(_) => Request::Reload,
        Cmd::Check(_) => Request::Check,
        Cmd::Stats(_) => Request::Stats,
    };
    let socket = socket(cli)?;
    let reply = match admin::call(&socket, request, Duration::from_secs(cli.timeout))? {
        Response::Ok { reply } => reply,
        Response::Error { kind, message } => return Err(Refused { kind, message }.into()),
    };
    if cli.json {
        println!("{}", serde_json::to_string_pretty(&reply)?);
        return Ok(());
    }
    print!("{}", text(&reply));
    Ok(())
}

/// The reply for people.
fn text(reply: &Reply) -> String {
    match reply {
        Reply::Volumes {
            volumes,
            blob_bytes,
        } => volumes_table(volumes, *blob_bytes),
        Reply::Sessions { sessions } => sessions_table(sessions),
        Reply::Disconnected { sessions } if sessions.is_empty() => {
            "no session matched; none ended\n".into()
        }
        Reply::Disconnected { sessions } => {
            let ids: Vec<String> = sessions.iter().map(u64::to_string).collect();
            format!("ended {} session(s): {}\n", sessions.len(), ids.join(" "))
        }
        Reply::Reloaded {
            applied,
            volumes,
            changed,
            restart_needed,
        } => reloaded(*applied, volumes, changed, restart_needed),
        Reply::Stats { stats } => serde_json::to_string_pretty(stats).unwrap_or_default() + "\n",
    }
}

fn volumes_table(volumes: &[VolumeInfo], blob_bytes: u64) -> String {
    let mut out = format!(
        "{:<20} {:>8} {:>12} {:>10} {:>10} {:>10} {:>10} {:>7} {:>8} {:>6}\n",
        "VOLUME",
        "SERVED",
        "CONFIDENTIAL",
        "QUOTA",
        "IN RAM",
        "ON SWAP",
        "TOTAL",
        "LEASES",
        "SESSIONS",
        "EPOCH"
    );
    for v in volumes {
        let size = |blobs: u64| ApproxSize(blobs * blob_bytes).to_string();
        out += &format!(
            "{:<20} {:>8} {:>12} {:>10} {:>10} {:>10} {:>10} {:>7} {:>8} {:>6}\n",
            v.name,
            if v.served { "yes" } else { "no" },
            if v.confidential { "yes" } else { "no" },
            HumanSize(v.quota_bytes).to_string(),
            size(v.resident),
            size(v.on_swap),
            size(v.blobs),
            v.leases,
            v.sessions,
            v.epoch
        );
    }
    out
}

fn sessions_table(sessions: &[SessionInfo]) -> String {
    let mut out = format!(
        "{:>6} {:<24} {:<20} {:<9} {:>5} {:>7} {:>8} {:>10} {:>10}\n",
        "ID", "PEER", "VOLUME", "TRANSPORT", "RAILS", "LEASES", "AGE", "BYTES IN", "BYTES OUT"
    );
    for s in sessions {
        out += &format!(
            "{:>6} {:<24} {:<20} {:<9} {:>5} {:>7} {:>7}s {:>10} {:>10}\n",
            s.id,
            s.peer,
            s.volume,
            s.transport,
            s.rails,
            s.leases,
            s.age_secs,
            ApproxSize(s.bytes_in).to_string(),
            ApproxSize(s.bytes_out).to_string()
        );
    }
    out
}

fn reloaded(
    applied: bool,
    volumes: &[String],
    changed: &[Change],
    restart_needed: &[Change],
) -> String {
    let mut out = String::new();
    let verb = if applied { "applied" } else { "would apply" };
    if volumes.is_empty() && changed.is_empty() && restart_needed.is_empty() {
        out += if applied {
            "reloaded: nothing changed\n"
        } else {
            "check: the configuration loads; nothing would change\n"
        };
    }
    for v in volumes {
        out += &format!("{verb}: {v}\n");
    }
    for c in changed {
        out += &format!("{verb}: {c}\n");
    }
    for c in restart_needed {
        out += &format!("needs a restart: {c}\n");
    }
    out
}
