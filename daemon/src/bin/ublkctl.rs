//! `ublkctl`: operate `ublkd`'s devices over its control socket.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args as ClapArgs, Parser, Subcommand};
use target_rdma::size::{parse_size, HumanSize};
use ublk_metrics::summarize;
use ublkd::config::TransportChoice;
use ublkd::coordination::PeerRecord;
use ublkd::ctl::{
    self, AddArgs, DeviceInfo, DeviceStatsInfo, ErrorKind, PeerInfo, Reply, Request, Response,
    StatsReply,
};

/// Control ublkd's block devices.
#[derive(Parser, Debug)]
#[command(version)]
pub(crate) struct Cli {
    /// ublkd's control socket.
    #[arg(long, global = true, default_value = "/run/ublkd/ublkd.sock")]
    socket: PathBuf,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// Seconds to wait for an answer (add and del can take a while).
    #[arg(long, global = true, default_value_t = 120)]
    timeout: u64,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Create a device; prints its /dev/ublkbN.
    Add(Add),
    /// Delete a device (refused while mounted or open, unless --force).
    Del(Del),
    /// List devices.
    List(List),
    /// Show one device.
    Show(Id),
    /// I/O counters of one device or all, and what the data path did.
    Stats(Stats),
    /// Re-attach a device whose queues stopped.
    Recover(Id),
    /// What the running kernel's ublk driver supports.
    Features(List),
    /// The placement pool in etcd: arena peers replicated volumes are placed on.
    #[command(subcommand)]
    Peer(PeerCmd),
}

// --- replication (issue 11): `ublkctl peer` ---
#[derive(Subcommand, Debug)]
enum PeerCmd {
    /// Register an arenad for placement.
    Add(PeerAdd),
    /// Unregister a peer (refused while a volume has replicas on it).
    Del(PeerId),
    /// List the registered peers and what is placed on them.
    List(List),
}

#[derive(ClapArgs, Debug)]
struct PeerAdd {
    /// Stable name, e.g. mem1.
    #[arg(long)]
    id: String,
    /// Its arenad's HOST:PORT.
    #[arg(long)]
    addr: String,
    /// Bytes of volumes it may hold, e.g. 512G.
    #[arg(long, value_parser = parse_size)]
    capacity: u64,
    /// Rack, power feed or zone; replicas of a volume go to distinct ones.
    #[arg(long)]
    failure_domain: Option<String>,
}

#[derive(ClapArgs, Debug)]
struct PeerId {
    /// Peer id.
    id: String,
}

fn peer_request(p: &PeerCmd) -> Request {
    match p {
        PeerCmd::Add(a) => Request::PeerAdd {
            peer: PeerRecord {
                id: a.id.clone(),
                addr: a.addr.clone(),
                capacity: a.capacity,
                failure_domain: a.failure_domain.clone(),
            },
        },
        PeerCmd::Del(d) => Request::PeerDel { id: d.id.clone() },
        PeerCmd::List(_) => Request::PeerList,
    }
}

fn print_peers(peers: &[PeerInfo]) {
    println!(
        "{:<16} {:<24} {:>9} {:>9} DOMAIN",
        "ID", "ADDR", "CAPACITY", "USED"
    );
    for p in peers {
        println!(
            "{:<16} {:<24} {:>9} {:>9} {}",
            p.peer.id,
            p.peer.addr,
            HumanSize(p.peer.capacity).to_string(),
            HumanSize(p.used).to_string(),
            p.peer.failure_domain.as_deref().unwrap_or("-")
        );
    }
}
// --- end replication ---

#[derive(ClapArgs, Debug)]
struct Add {
    /// arenad's HOST:PORT.
    #[arg(long)]
    peer: String,
    /// Volume name on arenad.
    #[arg(long)]
    volume: String,
    /// File with the volume's secret (read by ublkd).
    #[arg(long)]
    secret_file: PathBuf,
    /// Device size, e.g. 64G.
    #[arg(long, value_parser = parse_size)]
    size: u64,
    /// Hardware queues (one thread and arena connection each).
    #[arg(long)]
    queues: Option<u32>,
    /// Requests in flight per queue.
    #[arg(long)]
    depth: Option<u32>,
    /// Blob size to ask of the volume, e.g. 1M.
    #[arg(long, value_parser = parse_size)]
    blob_size: Option<u64>,
    /// Data path: tcp, rdma or auto.
    #[arg(long, value_parser = parse_transport)]
    transport: Option<TransportChoice>,
    /// Per-request buffer (and largest I/O), e.g. 512K.
    #[arg(long, value_parser = parse_size)]
    io_buf: Option<u64>,
}

#[derive(ClapArgs, Debug)]
struct Del {
    /// Device id (N of /dev/ublkbN).
    id: u32,
    /// Delete even if mounted or open (its users get I/O errors).
    #[arg(long)]
    force: bool,
}

#[derive(ClapArgs, Debug)]
struct List {}

#[derive(ClapArgs, Debug)]
struct Id {
    /// Device id (N of /dev/ublkbN).
    id: u32,
}

#[derive(ClapArgs, Debug)]
struct Stats {
    /// Device id; all devices when omitted.
    id: Option<u32>,
}

fn parse_transport(s: &str) -> Result<TransportChoice, String> {
    TransportChoice::parse(s)
        .ok_or_else(|| format!("unknown transport {s:?}: use tcp, rdma or auto"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ublkctl: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let request = match &cli.cmd {
        Cmd::Add(a) => {
            let secret_file = std::path::absolute(&a.secret_file)
                .with_context(|| format!("--secret-file {}", a.secret_file.display()))?;
            Request::Add(AddArgs {
                peer: a.peer.clone(),
                volume: a.volume.clone(),
                secret_file,
                size: a.size,
                queues: a.queues,
                depth: a.depth,
                blob_size: a.blob_size,
                transport: a.transport,
                io_buf: a.io_buf,
            })
        }
        Cmd::Del(d) => Request::Del {
            id: d.id,
            force: d.force,
        },
        Cmd::List(_) => Request::List,
        Cmd::Show(i) => Request::Show { id: i.id },
        Cmd::Stats(s) => Request::Stats { id: s.id },
        Cmd::Recover(i) => Request::Recover { id: i.id },
        Cmd::Features(_) => Request::Features,
        Cmd::Peer(p) => peer_request(p),
    };
    let response = ctl::call(&cli.socket, request, Duration::from_secs(cli.timeout))?;
    let reply = match response {
        Response::Ok { reply } => reply,
        Response::Error { kind, message } => {
            if cli.json {
                println!(
                    "{}",
                    serde_json::json!({"error": {"kind": kind, "message": message}})
                );
            }
            bail!("{}", explain(kind, &message));
        }
    };
    if cli.json {
        println!("{}", serde_json::to_string_pretty(&reply)?);
        return Ok(());
    }
    print_human(&cli.cmd, &reply)
}

/// Adds the next step to errors where one is obvious.
fn explain(kind: ErrorKind, message: &str) -> String {
    match kind {
        ErrorKind::PeerUnreachable => format!("{message} (is arenad running and reachable?)"),
        ErrorKind::AuthFailed => {
            format!("authentication failed: {message} (check --volume and --secret-file)")
        }
        _ => message.to_owned(),
    }
}

fn print_device(d: &DeviceInfo) {
    println!("device {}  {}", d.id, d.node);
    println!("  state      {}", d.state);
    if let Some(e) = &d.error {
        println!("  error      {e}");
    }
    println!("  size       {} ({} bytes)", HumanSize(d.size), d.size);
    println!("  queues     {} x depth {}", d.queues, d.depth);
    println!("  io buffer  {}", HumanSize(d.io_buf));
    println!("  blob size  {}", HumanSize(d.blob_size));
    println!("  block size {}", d.logical_block_size);
    println!("  peer       {}", d.peer);
    println!("  volume     {}", d.volume);
    println!(
        "  transport  {} (requested {})",
        d.transport, d.transport_requested
    );
    if let Some(why) = &d.transport_note {
        println!("  tcp because {why}");
    }
}

fn print_stats(d: &DeviceStatsInfo) {
    let s = &d.stats;
    println!("device {}  {}", d.id, d.node);
    println!(
        "  reads         {:>12}  {:>14} bytes",
        s.reads, s.bytes_read
    );
    println!(
        "  writes        {:>12}  {:>14} bytes",
        s.writes, s.bytes_written
    );
    println!("  flushes       {:>12}", s.flushes);
    println!(
        "  discards      {:>12}  {:>14} bytes (with write-zeroes)",
        s.discards, s.bytes_discarded
    );
    println!("  write-zeroes  {:>12}", s.write_zeroes);
    println!("  errors        {:>12}", s.errors);
    println!("  in flight     {:>12}", s.in_flight);
    println!(
        "  stalled       {:>12}  (oldest in flight {} ms)",
        d.stalled, d.oldest_inflight_ms
    );
}

fn print_human(cmd: &Cmd, reply: &Reply) -> anyhow::Result<()> {
    match (cmd, reply) {
        (Cmd::Add(_), Reply::Device { device }) => println!("{}", device.node),
        (_, Reply::Device { device }) => print_device(device),
        (_, Reply::Deleted { id }) => println!("deleted /dev/ublkb{id}"),
        (_, Reply::Devices { devices }) => {
            println!(
                "{:<4} {:<13} {:>8} {:>8} {:<10} {:<22} {:<16} TRANSPORT",
                "ID", "NODE", "SIZE", "Q/DEPTH", "STATE", "PEER", "VOLUME"
            );
            for d in devices {
                println!(
                    "{:<4} {:<13} {:>8} {:>8} {:<10} {:<22} {:<16} {}",
                    d.id,
                    d.node,
                    HumanSize(d.size).to_string(),
                    format!("{}/{}", d.queues, d.depth),
                    d.state,
                    d.peer,
                    d.volume,
                    d.transport
                );
            }
        }
        (_, Reply::Stats(StatsReply { devices, driver })) => {
            for d in devices {
                print_stats(d);
            }
            let block = summarize(driver);
            if !block.is_empty() {
                println!("data path");
                for line in block.lines() {
                    println!("  {line}");
                }
            }
        }
        (_, Reply::Peers { peers }) => print_peers(peers),
        (_, Reply::PeerDeleted { id }) => println!("unregistered peer {id}"),
        (_, Reply::Features { mask, names }) => {
            println!("ublk driver features: {mask:#x}");
            for n in names {
                println!("  {n}");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn bad_sizes_and_transports_are_rejected_with_the_reason() {
        let e = Cli::try_parse_from([
            "ublkctl",
            "add",
            "--peer",
            "h:1",
            "--volume",
            "v",
            "--secret-file",
            "/s",
            "--size",
            "64Q",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("invalid size \"64Q\": unknown unit"), "{e}");
        let e = Cli::try_parse_from([
            "ublkctl",
            "add",
            "--peer",
            "h:1",
            "--volume",
            "v",
            "--secret-file",
            "/s",
            "--size",
            "1G",
            "--transport",
            "udp",
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("unknown transport \"udp\": use tcp, rdma or auto"),
            "{e}"
        );
    }

    #[test]
    fn peer_and_auth_errors_get_a_hint() {
        assert_eq!(
            explain(ErrorKind::PeerUnreachable, "cannot connect"),
            "cannot connect (is arenad running and reachable?)"
        );
        assert!(explain(ErrorKind::AuthFailed, "x").starts_with("authentication failed: x"));
        assert_eq!(explain(ErrorKind::Busy, "busy"), "busy");
    }

    #[test]
    fn a_missing_daemon_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let cli = Cli::try_parse_from([
            "ublkctl",
            "--socket",
            dir.path().join("none.sock").to_str().unwrap(),
            "list",
        ])
        .unwrap();
        let e = run(&cli).unwrap_err().to_string();
        assert!(e.starts_with("ublkd is not running"), "{e}");
    }
}
