//! `ublkctl`: operate `ublkd`'s devices over its control socket.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args as ClapArgs, Parser, Subcommand};
use target_rdma::service::local_socket;
use target_rdma::service::size::{parse_size, HumanSize};
use ublk_metrics::driver::RailValue;
use ublk_metrics::{summarize, DeviceDriverReport};
use ublkd::config::{TransportChoice, UblkdConfig, DEFAULT_CONFIG_PATH};
use ublkd::coordination::PeerRecord;
use ublkd::ctl::{
    self, AddArgs, DeviceInfo, DeviceStatsInfo, ErrorKind, PeerInfo, ReplicasInfo, Reply, Request,
    Response, StatsReply,
};
use ublkd::device::DeviceSpec;
use ublkd::features;

/// Control ublkd's block devices.
#[derive(Parser, Debug)]
#[command(name = "ublkctl", version)]
pub(crate) struct Cli {
    /// ublkd's control socket [default: $UBLKCTL_SOCKET, else the `socket`
    /// of ublkd's config, else /run/ublkd/ublkd.sock].
    #[arg(long, global = true)]
    socket: Option<PathBuf>,
    /// ublkd's config, read for its `socket` when neither --socket nor
    /// $UBLKCTL_SOCKET is given.
    #[arg(long, global = true, default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
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
    /// Take a standby device's writer role: the writer flushes and hands
    /// it over (or, not answering, loses it when its lease expires).
    Activate(Id),
    /// Hand a replicated device's writer role over to the standby asking
    /// for it: stop acknowledging writes, flush, give the role up.
    Release(Id),
    /// Grow a live device; prints its node and new size. Needs a ublk
    /// driver with UPDATE_SIZE (Linux 6.16 or later); shrinking is refused.
    Resize(Resize),
    /// What the running kernel's ublk driver supports (asks the driver;
    /// ublkd need not run).
    Features(List),
    /// The placement pool in etcd: arena peers replicated volumes are placed on.
    #[command(subcommand)]
    Peer(PeerCmd),
    /// Make ublkd re-read its configuration file and apply what can change
    /// while it runs (as SIGHUP does); prints what changed. Exits 1, with
    /// the reason, when the file does not load or validate: ublkd keeps
    /// its running configuration. The units' ExecReload runs it, so
    /// `systemctl reload ublkd` fails on a bad file.
    Reload(List),
    /// Print the volume of device N, from ublkd's device definitions (for
    /// the udev rule that makes /dev/disk/by-id/ublk-<volume>).
    #[command(hide = true)]
    UdevName(Id),
}

// --- replication: `ublkctl peer` ---
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
    // --- replication ---
    /// arenad's HOST:PORT; repeat it for a replicated volume (one replica
    /// per peer). Without it, placement in etcd chooses --replicas peers,
    /// and a --standby follows the members the volume's record names.
    #[arg(long, required_unless_present_any = ["replicas", "standby"])]
    peer: Vec<String>,
    /// Replicas of the volume, 1 to 5 (default: the number of --peer).
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=5))]
    replicas: Option<u8>,
    // --- end replication ---
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
    #[arg(long, value_enum)]
    transport: Option<TransportChoice>,
    /// Encrypt the device's traffic: every frame, payloads included, sealed
    /// with AES-256-GCM (protocol version 3). TCP only: refused with
    /// --transport rdma; auto means TCP.
    #[arg(long)]
    confidential: bool,
    /// Per-request buffer (and largest I/O), e.g. 512K.
    #[arg(long, value_parser = parse_size)]
    io_buf: Option<u64>,
    /// Device id to take (N of /dev/ublkbN); a free one when omitted.
    #[arg(short = 'n', long = "number")]
    number: Option<u32>,
    /// Expose the device read-only (the kernel refuses writes to it).
    #[arg(long)]
    read_only: bool,
    /// Add a volume another ublkd serves without taking its writer role
    /// (needs [etcd]): reads are served, writes refused until `activate`
    /// hands the role over (a live migration's destination).
    #[arg(long)]
    standby: bool,
    /// With --standby: the first write takes the writer role (asks the
    /// writer to hand over and waits for it) instead of being refused.
    #[arg(long, requires = "standby")]
    activate_on_write: bool,
    /// Pin queue q's thread to the q-th CPU of this list (round robin),
    /// e.g. 0,2,4-7; the kernel's queue mapping when omitted.
    #[arg(long, value_parser = parse_cpus)]
    cpus: Option<CpuList>,
    /// Return only once /dev/ublkbN exists (udev made it), within --timeout.
    #[arg(long)]
    wait: bool,
}

#[derive(ClapArgs, Debug)]
struct Del {
    /// Device id (N of /dev/ublkbN).
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    id: Option<u32>,
    /// Delete every device (each refused while mounted or open, unless
    /// --force); exits 1 if any is left.
    #[arg(long)]
    all: bool,
    /// Delete even if mounted or open (its users get I/O errors).
    #[arg(long)]
    force: bool,
}

#[derive(ClapArgs, Debug)]
struct Resize {
    /// Device id (N of /dev/ublkbN).
    id: u32,
    /// The new size, e.g. 128G: a multiple of the logical block size, at
    /// least the current size and within the volume's quota.
    #[arg(long, value_parser = parse_size)]
    size: u64,
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
    /// Seconds between the two samples the rates and latencies come from;
    /// 0 prints totals and latencies since each device started (--json
    /// always prints one sample).
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
}

/// A `--cpus` list, one value to clap (a bare `Vec` would be many).
#[derive(Clone, Debug)]
struct CpuList(Vec<u32>);

/// `0,2,4-7` -> [0, 2, 4, 5, 6, 7].
fn parse_cpus(s: &str) -> Result<CpuList, String> {
    let mut out = Vec::new();
    for part in s.split(',') {
        let bad = || format!("invalid CPU list {s:?}: use numbers and ranges like 0,2,4-7");
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (u32, u32) = (
            a.trim().parse().map_err(|_| bad())?,
            b.trim().parse().map_err(|_| bad())?,
        );
        if a > b || b - a > 4096 {
            return Err(bad());
        }
        out.extend(a..=b);
    }
    Ok(CpuList(out))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let message = target_rdma::service::error_chain::one_line(e.chain());
            if cli.json {
                // ublkd's class when it refused, `client` when ublkctl
                // failed on its own (no daemon, no driver, a bad config).
                let error = match e.downcast_ref::<Refused>() {
                    Some(r) => serde_json::json!({"kind": r.kind, "message": r.message}),
                    None => serde_json::json!({"kind": "client", "message": message}),
                };
                println!("{}", serde_json::json!({ "error": error }));
            }
            eprintln!("ublkctl: {message}");
            ExitCode::FAILURE
        }
    }
}

/// ublkd's refusal of a request, kept typed so that `--json` prints its
/// class; shown to people with the likely remedy.
#[derive(Debug)]
struct Refused {
    kind: ErrorKind,
    message: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&explain(self.kind, &self.message))
    }
}

impl std::error::Error for Refused {}

/// The control socket: --socket, else $UBLKCTL_SOCKET, else the `socket`
/// of ublkd's config when that file exists, else the packaged default.
fn socket(cli: &Cli) -> anyhow::Result<PathBuf> {
    if let Some(s) = &cli.socket {
        return Ok(s.clone());
    }
    if let Some(s) = std::env::var_os("UBLKCTL_SOCKET").filter(|s| !s.is_empty()) {
        return Ok(PathBuf::from(s));
    }
    let set = local_socket::configured_socket(&cli.config, "socket").with_context(|| {
        format!(
            "reading {} to find the control socket (pass --socket to skip the config)",
            cli.config.display()
        )
    })?;
    Ok(set.map_or_else(|| UblkdConfig::defaults().socket, PathBuf::from))
}

/// One request, its answer or the daemon's error (explained).
fn call(cli: &Cli, request: Request) -> anyhow::Result<Reply> {
    match ctl::call(&socket(cli)?, request, Duration::from_secs(cli.timeout))? {
        Response::Ok { reply } => Ok(reply),
        Response::Error { kind, message } => Err(Refused { kind, message }.into()),
    }
}

/// `del --all`: every listed device, one after the other.
fn del_all(cli: &Cli, force: bool) -> anyhow::Result<()> {
    let Reply::Devices { devices } = call(cli, Request::List)? else {
        bail!("ublkd answered list with something else");
    };
    let mut left = Vec::new();
    for d in devices {
        match call(cli, Request::Del { id: d.id, force }) {
            Ok(_) => println!("deleted {}", d.node),
            Err(e) => {
                eprintln!("ublkctl: {e:#}");
                left.push(d.id.to_string());
            }
        }
    }
    if !left.is_empty() {
        bail!("{} device(s) left: {}", left.len(), left.join(", "));
    }
    Ok(())
}

/// `add --confidential` answered by a ublkd that does not know the key
/// (it ignores it, and its answer has no `confidential`): the device it
/// made moves the volume's data readable, which must not pass unsaid.
fn check_confidential(a: &Add, device: &DeviceInfo) -> anyhow::Result<()> {
    if a.confidential && !device.confidential {
        bail!(
            "ublkd made {} without --confidential (it predates the option): its frames are \
             not sealed; delete it (`ublkctl del {}`) and upgrade ublkd",
            device.node,
            device.id
        );
    }
    Ok(())
}

/// `add --wait`: until the node is a block device, or the timeout.
fn wait_for_node(node: &str, timeout: Duration) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if std::fs::metadata(node).is_ok_and(|m| m.file_type().is_block_device()) {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            bail!(
                "{node} did not appear within {} s (is udev running?); the device exists, see `ublkctl list`",
                timeout.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `udev-name N`: the volume in `<state_dir>/devices/N.json`. udev runs
/// this when the kernel announces /dev/ublkbN, which can be a moment before
/// ublkd has written the definition, so it waits for it up to 5 s.
fn udev_name(cli: &Cli, id: u32) -> anyhow::Result<()> {
    let state_dir = if cli.config.exists() {
        UblkdConfig::load(&cli.config)?.state_dir
    } else {
        UblkdConfig::defaults().state_dir
    };
    let path = state_dir.join("devices").join(format!("{id}.json"));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let text = loop {
        match std::fs::read_to_string(&path) {
            Ok(t) => break t,
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => bail!("device definition {}: {e}", path.display()),
        }
    };
    let spec: DeviceSpec = serde_json::from_str(&text)
        .with_context(|| format!("device definition {}", path.display()))?;
    println!("{}", spec.volume);
    Ok(())
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    if let Cmd::Del(Del {
        all: true, force, ..
    }) = &cli.cmd
    {
        return del_all(cli, *force);
    }
    let request = match &cli.cmd {
        Cmd::Add(a) => {
            let secret_file = std::path::absolute(&a.secret_file)
                .with_context(|| format!("--secret-file {}", a.secret_file.display()))?;
            Request::Add(AddArgs {
                peers: a.peer.clone(),
                replicas: a.replicas,
                volume: a.volume.clone(),
                secret_file,
                size: a.size,
                queues: a.queues,
                depth: a.depth,
                blob_size: a.blob_size,
                transport: a.transport,
                confidential: a.confidential,
                io_buf: a.io_buf,
                id: a.number,
                read_only: a.read_only,
                standby: a.standby,
                activate_on_write: a.activate_on_write,
                cpus: a.cpus.clone().map(|c| c.0).unwrap_or_default(),
            })
        }
        Cmd::Del(d) => Request::Del {
            id: d.id.context("a device id or --all")?,
            force: d.force,
        },
        Cmd::List(_) => Request::List,
        Cmd::Show(i) => Request::Show { id: i.id },
        Cmd::Stats(s) => Request::Stats { id: s.id },
        Cmd::Recover(i) => Request::Recover { id: i.id },
        Cmd::Activate(i) => Request::Activate { id: i.id },
        Cmd::Release(i) => Request::Release { id: i.id },
        Cmd::Resize(r) => Request::Resize {
            id: r.id,
            size: r.size,
        },
        Cmd::Peer(p) => peer_request(p),
        Cmd::Reload(_) => Request::Reload,
        // Answered here, without ublkd.
        Cmd::Features(_) => {
            let (mask, names) = features::from_driver()?;
            return print_output(cli, &Reply::Features { mask, names });
        }
        Cmd::UdevName(i) => return udev_name(cli, i.id),
    };
    let reply = call(cli, request)?;
    if let (Cmd::Add(a), Reply::Device { device }) = (&cli.cmd, &reply) {
        check_confidential(a, device)?;
    }
    if let (Cmd::Add(Add { wait: true, .. }), Reply::Device { device }) = (&cli.cmd, &reply) {
        wait_for_node(&device.node, Duration::from_secs(cli.timeout))?;
    }
    if let (Cmd::Stats(s), Reply::Stats(first), false) = (&cli.cmd, &reply, cli.json) {
        if s.interval > 0.0 {
            return print_rates(cli, s, first);
        }
    }
    print_output(cli, &reply)
}

/// The answer as JSON (--json) or for people.
fn print_output(cli: &Cli, reply: &Reply) -> anyhow::Result<()> {
    if cli.json {
        println!("{}", serde_json::to_string_pretty(reply)?);
        return Ok(());
    }
    print_human(&cli.cmd, reply)
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
    println!(
        "  size       {} ({} bytes){}",
        HumanSize(d.size),
        d.size,
        if d.read_only { ", read-only" } else { "" }
    );
    println!("  queues     {} x depth {}", d.queues, d.depth);
    if !d.cpus.is_empty() {
        let cpus: Vec<String> = d.cpus.iter().map(u32::to_string).collect();
        println!("  cpus       {} (queue q on the q-th)", cpus.join(","));
    }
    println!("  io buffer  {}", HumanSize(d.io_buf));
    println!("  blob size  {}", HumanSize(d.blob_size));
    println!("  block size {}", d.logical_block_size);
    match &d.replicas {
        None => println!("  peer       {}", d.peer),
        Some(r) => print_replicas(r),
    }
    println!("  volume     {}", d.volume);
    println!(
        "  transport  {} (requested {})",
        d.transport, d.transport_requested
    );
    if let Some(why) = &d.transport_note {
        println!("  tcp because {why}");
    }
    println!("  frames     {}", frames(d));
    for r in &d.rails {
        print_rail(r);
    }
}

/// How the device's frames are protected on the wire.
fn frames(d: &DeviceInfo) -> &'static str {
    if d.confidential {
        "sealed (AES-256-GCM, protocol v3)"
    } else {
        "tagged (BLAKE3, protocol v2)"
    }
}

/// One line per RDMA rail: its device and state, since when it is down,
/// what it carried.
fn print_rail(r: &RailValue) {
    let mut line = format!(
        "  rail {}     {} {} ({}/{} queues up)",
        r.rail,
        r.rdma_device,
        r.state(),
        r.queues_up,
        r.queues
    );
    if let Some(since) = r.down_since_ms {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        line += &format!(", down for {} s", now.saturating_sub(since) / 1000);
    }
    line += &format!(
        ", {} moved in {} transfers, {} lost, {} connects",
        HumanSize(r.bytes),
        r.transfers,
        r.lost,
        r.connects
    );
    println!("{line}");
    if let Some(why) = &r.off {
        println!("    off because {why}");
    }
}

// --- replication ---
fn print_replicas(r: &ReplicasInfo) {
    for line in r.show_lines() {
        println!("{line}");
    }
}

/// `list`'s PEER column: the peer, or a replicated volume's health.
fn peer_column(d: &DeviceInfo) -> String {
    match &d.replicas {
        None => d.peer.clone(),
        Some(r) => {
            let active = r.active;
            let role = match r.role.as_str() {
                "writer" => String::new(),
                other => format!(" {}", other.to_uppercase()),
            };
            format!("{}/{active} replicas e{}{role}", r.healthy, r.epoch)
        }
    }
}
// --- end replication ---

/// Latency as people read it: `850 us`, `12.5 ms`, `1.2 s`.
fn latency(d: Option<Duration>) -> String {
    match d {
        None => "-".into(),
        Some(d) if d < Duration::from_millis(1) => format!("{} us", d.as_micros()),
        Some(d) if d < Duration::from_secs(1) => format!("{:.1} ms", d.as_secs_f64() * 1e3),
        Some(d) => format!("{:.1} s", d.as_secs_f64()),
    }
}

/// One device: per op the requests and bytes (totals), their rate over
/// the interval between `earlier` and `d` (`secs`; none without an
/// interval), and p50/p99 latency of the requests completed in it (since
/// the device started without an interval).
fn print_stats(d: &DeviceStatsInfo, earlier: Option<&DeviceStatsInfo>, secs: f64) {
    let s = &d.stats;
    let e = earlier.map(|e| &e.stats);
    println!("device {}  {}", d.id, d.node);
    println!(
        "  {:<13} {:>12} {:>10} {:>14} {:>10} {:>9} {:>9}",
        "op", "requests", "req/s", "bytes", "MiB/s", "p50", "p99"
    );
    let rows = [
        (
            "reads",
            s.reads,
            Some(s.bytes_read),
            e.map(|e| (e.reads, e.bytes_read)),
        ),
        (
            "writes",
            s.writes,
            Some(s.bytes_written),
            e.map(|e| (e.writes, e.bytes_written)),
        ),
        ("flushes", s.flushes, None, e.map(|e| (e.flushes, 0))),
        // DISCARD and WRITE_ZEROES share one byte counter.
        (
            "discards",
            s.discards,
            Some(s.bytes_discarded),
            e.map(|e| (e.discards, e.bytes_discarded)),
        ),
        (
            "write-zeroes",
            s.write_zeroes,
            None,
            e.map(|e| (e.write_zeroes, 0)),
        ),
    ];
    for (i, (name, count, bytes, before)) in rows.into_iter().enumerate() {
        let hist = match e {
            Some(e) => s.latency[i].since(&e.latency[i]),
            None => s.latency[i],
        };
        let rate = |now: u64, then: u64| format!("{:.1}", now.saturating_sub(then) as f64 / secs);
        let (req_s, mib_s) = match before {
            Some((c, b)) if secs > 0.0 => (
                rate(count, c),
                bytes.map_or("-".into(), |n| {
                    format!(
                        "{:.1}",
                        n.saturating_sub(b) as f64 / secs / f64::from(1 << 20)
                    )
                }),
            ),
            _ => ("-".into(), "-".into()),
        };
        println!(
            "  {:<13} {:>12} {:>10} {:>14} {:>10} {:>9} {:>9}",
            name,
            count,
            req_s,
            bytes.map_or("-".into(), |b| b.to_string()),
            mib_s,
            latency(hist.quantile(0.5)),
            latency(hist.quantile(0.99)),
        );
    }
    println!("  errors        {:>12}", s.errors);
    println!("  in flight     {:>12}", s.in_flight);
    println!(
        "  stalled       {:>12}  (oldest in flight {} ms)",
        d.stalled, d.oldest_inflight_ms
    );
}

/// `stats` with an interval: a second sample `s.interval` seconds after
/// `first`, and the rates between them.
fn print_rates(cli: &Cli, s: &Stats, first: &StatsReply) -> anyhow::Result<()> {
    let interval = Duration::try_from_secs_f64(s.interval)
        .with_context(|| format!("--interval {}", s.interval))?;
    std::thread::sleep(interval);
    let Reply::Stats(second) = call(cli, Request::Stats { id: s.id })? else {
        bail!("ublkd answered stats with something else");
    };
    println!("rates and latencies over {:.1} s", interval.as_secs_f64());
    for d in &second.devices {
        // A device new since the first sample has no rate yet.
        let earlier = first.devices.iter().find(|e| e.id == d.id);
        print_stats(d, earlier, if earlier.is_some() { s.interval } else { 0.0 });
    }
    print_data_path(&second.driver);
    Ok(())
}

/// What the devices' data-path drivers did (`summarize`), indented.
fn print_data_path(driver: &[DeviceDriverReport]) {
    let block = summarize(driver);
    if !block.is_empty() {
        println!("data path");
        for line in block.lines() {
            println!("  {line}");
        }
    }
}

fn print_human(cmd: &Cmd, reply: &Reply) -> anyhow::Result<()> {
    match (cmd, reply) {
        (Cmd::Add(_), Reply::Device { device }) => println!("{}", device.node),
        (Cmd::Resize(_), Reply::Device { device }) => println!(
            "{}  {} ({} bytes)",
            device.node,
            HumanSize(device.size),
            device.size
        ),
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
                    peer_column(d),
                    d.volume,
                    d.transport
                );
            }
        }
        (_, Reply::Stats(StatsReply { devices, driver })) => {
            for d in devices {
                print_stats(d, None, 0.0);
            }
            print_data_path(driver);
        }
        (_, Reply::Peers { peers }) => print_peers(peers),
        (_, Reply::PeerDeleted { id }) => println!("unregistered peer {id}"),
        (
            _,
            Reply::Reloaded {
                applied,
                restart_needed,
            },
        ) => {
            println!("reloaded: {} change(s) applied", applied.len());
            for c in applied {
                println!("  applied         {c}");
            }
            for c in restart_needed {
                println!("  restart needed  {c}");
            }
        }
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
        let e = add(&["--peer", "h:1", "--transport", "udp"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("invalid value 'udp' for '--transport <TRANSPORT>'")
                && e.contains("[possible values: tcp, rdma, auto]"),
            "{e}"
        );
    }

    /// `ublkctl add` of a 1G volume with `extra` arguments (a peer or a
    /// replica count among them).
    fn add(extra: &[&str]) -> Result<Cli, clap::Error> {
        let mut argv = vec![
            "ublkctl",
            "add",
            "--volume",
            "v",
            "--secret-file",
            "/s",
            "--size",
            "1G",
        ];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv)
    }

    #[test]
    fn add_takes_peers_repeated_or_a_replica_count() {
        let Cmd::Add(a) = add(&["--peer", "h:1", "--peer", "h:2"]).unwrap().cmd else {
            panic!("an add")
        };
        assert_eq!(
            (a.peer, a.replicas),
            (vec!["h:1".into(), "h:2".into()], None)
        );
        let Cmd::Add(a) = add(&["--replicas", "3"]).unwrap().cmd else {
            panic!("an add")
        };
        assert_eq!((a.peer.len(), a.replicas), (0, Some(3)));
        assert!(add(&["--replicas", "6"]).is_err(), "1..=5");
        assert!(add(&[]).is_err(), "a peer or a replica count");
    }

    #[test]
    fn add_confidential_is_a_flag_and_show_says_how_frames_are_protected() {
        let Cmd::Add(a) = add(&["--peer", "h:1"]).unwrap().cmd else {
            panic!("an add")
        };
        assert!(!a.confidential);
        let Cmd::Add(a) = add(&["--peer", "h:1", "--confidential", "--transport", "tcp"])
            .unwrap()
            .cmd
        else {
            panic!("an add")
        };
        assert!(a.confidential);
        assert!(add(&["--peer", "h:1", "--confidential=yes"]).is_err());

        let mut d: DeviceInfo = serde_json::from_str(
            r#"{"id":3,"node":"/dev/ublkb3","size":4096,"queues":1,"depth":64,"io_buf":524288,"blob_size":65536,"state":"live","error":null,"peer":"h:1","volume":"v","transport":"tcp","transport_requested":"auto","logical_block_size":512}"#,
        )
        .unwrap();
        assert_eq!(frames(&d), "tagged (BLAKE3, protocol v2)");
        // A ublkd from before the option made the device in the clear:
        // `add --confidential` must not pass as if it had not.
        let e = check_confidential(&a, &d).unwrap_err().to_string();
        assert_eq!(
            e,
            "ublkd made /dev/ublkb3 without --confidential (it predates the option): its frames \
             are not sealed; delete it (`ublkctl del 3`) and upgrade ublkd"
        );
        d.confidential = true;
        assert_eq!(frames(&d), "sealed (AES-256-GCM, protocol v3)");
        check_confidential(&a, &d).unwrap();
    }

    #[test]
    fn resize_takes_an_id_and_a_size_like_add() {
        let cli = Cli::try_parse_from(["ublkctl", "resize", "3", "--size", "128G"]).unwrap();
        let Cmd::Resize(r) = cli.cmd else {
            panic!("a resize")
        };
        assert_eq!((r.id, r.size), (3, 128 << 30));
        let e = Cli::try_parse_from(["ublkctl", "resize", "3", "--size", "1X"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("invalid size \"1X\": unknown unit"), "{e}");
        assert!(Cli::try_parse_from(["ublkctl", "resize", "3"]).is_err());
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
