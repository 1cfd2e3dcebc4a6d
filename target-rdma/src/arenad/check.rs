//! `arenad --check`: every check a start makes before it opens the store,
//! without starting. A start refuses an invalid config (checked before
//! this runs), an unusable secret file, `rdma = "on"` without a usable RDMA
//! device (or, with `rdma_isolation = "lease"`, one that cannot make a
//! protection domain per session), a `swap_dir` it cannot create or write
//! or that lacks room for its files, a `swap_dir` another arenad holds,
//! and a control address it cannot bind, a damaged or incomplete store
//! (checkpoint, journal, extent table, swap file: read as a start reads
//! them, nothing written) and a damaged epochs file; it tolerates a metrics
//! address it cannot bind and `auto` finding no RDMA device, and serves a
//! store with a damaged spare checkpoint slot or blobs whose images fail
//! their headers, which are warnings here. (`--repair` rebuilds a store
//! index a start refuses.)

use crate::arenad::config::ArenadConfig;
use crate::arenad::epochs::{self, Epochs, EPOCHS_FILE};
use crate::auth::Secret;
use crate::rdma::{open_provider, Isolation, RdmaMode};
use crate::service::preflight::{
    bindable, dir_usable, lock_held, lockable, mapping_fits, room_for, Findings, Memory,
};
use crate::service::size::ApproxSize;
use crate::store::{footprint, Store, StoreConfig, VolumeSpec};

/// The store a start of `cfg` opens (what `--check` reads and `--repair`
/// rebuilds): where and how big, and its volumes with their quotas in
/// blobs.
pub fn store_of(cfg: &ArenadConfig) -> (StoreConfig, Vec<VolumeSpec>) {
    let store = StoreConfig {
        dir: cfg.swap_dir.clone(),
        arena_bytes: cfg.arena_bytes,
        blob_bytes: cfg.blob_bytes as u32,
        swap_bytes: cfg.swap_bytes,
        swap_reads_in_flight: cfg.swap_reads_in_flight,
    };
    let specs = cfg
        .volumes
        .iter()
        .map(|v| VolumeSpec {
            name: v.name.clone(),
            quota_blobs: v.quota.div_ceil(cfg.blob_bytes),
        })
        .collect();
    (store, specs)
}

/// Runs the checks of a start of `cfg`.
pub fn run(cfg: &ArenadConfig) -> Findings {
    let mut f = Findings::default();
    for v in &cfg.volumes {
        match Secret::from_file(&v.secret_file) {
            Ok(_) => f.ok(format!(
                "volume {:?}: secret file {} is usable",
                v.name,
                v.secret_file.display()
            )),
            Err(e) => f.problem(format!("volume {:?}: {e}", v.name)),
        }
    }
    let selectors = cfg.rdma_selectors();
    let mut pinning_checked = false;
    for (i, sel) in selectors.iter().enumerate() {
        let rail = if selectors.len() > 1 {
            format!("rail {i}: ")
        } else {
            String::new()
        };
        match (cfg.rdma, open_provider(cfg.rdma, sel)) {
            (_, Ok(Ok(p))) => {
                f.ok(format!("{rail}RDMA device {} usable", p.device_name()));
                if !std::mem::replace(&mut pinning_checked, true) {
                    pinning(&mut f, cfg);
                }
                match (cfg.rdma_isolation, p.limits(), p.new_domain()) {
                    (Isolation::Lease, Ok(l), Ok(_)) => f.ok(format!(
                        "{rail}rdma_isolation = \"lease\": a protection domain per RDMA session and a \
                         memory region per lease (device max_pd {}, max_mr {}): an RDMA key reaches \
                         only the slot its session leases",
                        l.max_pd, l.max_mr
                    )),
                    (Isolation::Lease, Err(e), _) | (Isolation::Lease, _, Err(e)) => {
                        f.problem(format!(
                            "{rail}rdma_isolation = \"lease\": {e} (rdma_isolation = \"shared\" would \
                             trust every RDMA client with every volume)"
                        ))
                    }
                    (Isolation::Shared, _, _) => f.warn(format!(
                        "{rail}rdma_isolation = \"shared\": one key to the whole arena for every RDMA \
                         session: any authenticated RDMA client can read and write every volume's \
                         slots (see OPERATIONS.md, RDMA isolation)"
                    )),
                }
            }
            (RdmaMode::Off, _) => {
                f.ok("RDMA off (rdma = \"off\")");
                break;
            }
            (_, Ok(Err(why))) => f.warn(format!(
                "{rail}no usable RDMA device ({why}): rdma = \"auto\" serves {}",
                if selectors.len() > 1 {
                    "the other rail, or TCP only"
                } else {
                    "TCP only"
                }
            )),
            (_, Err(e)) => f.problem(format!("{rail}rdma = \"on\": {e}")),
        }
    }
    match Memory::of_host() {
        Ok(m) => mapping_fits(&mut f, "arena_bytes", cfg.arena_bytes, &m),
        Err(e) => f.warn(format!("the host's memory could not be read: {e}")),
    }
    let quotas = cfg
        .volumes
        .iter()
        .map(|v| v.quota)
        .fold(0u64, u64::saturating_add);
    let capacity = cfg.arena_bytes.saturating_add(cfg.swap_bytes);
    if quotas > capacity {
        f.warn(format!(
            "the volumes' quotas add up to {}, more than the arena and swap hold ({}): \
             volumes can run out of space (NO_SPACE) below their quotas",
            ApproxSize(quotas),
            ApproxSize(capacity)
        ));
    }
    let dir = &cfg.swap_dir;
    let (store, specs) = store_of(cfg);
    match dir_usable("swap_dir", dir) {
        Ok(l) => {
            f.ok(l);
            let mut files = footprint(&store);
            files.push((EPOCHS_FILE, epochs::file_bytes(specs.len())));
            f.check(room_for("swap_dir", dir, &files));
        }
        Err(l) => f.problem(l),
    }
    match lock_held(&dir.join("lock")) {
        Ok(false) => check_store(&mut f, &store, &specs),
        Ok(true) => f.problem(format!(
            "swap_dir {}: another arenad has it open (its lock file is held)",
            dir.display()
        )),
        Err(e) => f.problem(format!("swap_dir {}: lock file: {e}", dir.display())),
    }
    f.check(bindable("listen", &cfg.listen));
    match cfg.metrics_listen_addr() {
        Some(addr) => match bindable("metrics_listen", addr) {
            Ok(l) => f.ok(l),
            Err(e) => f.warn(format!(
                "{e}: arenad would serve without its metrics listener"
            )),
        },
        None => f.ok("metrics listener disabled (metrics_listen = \"off\")"),
    }
    f
}

/// Registering memory pins it: the whole arena at start when shared, the
/// leased slots as they are leased otherwise.
fn pinning(f: &mut Findings, cfg: &ArenadConfig) {
    match (cfg.rdma_isolation, lockable(cfg.arena_bytes)) {
        (_, None) => f.ok(format!(
            "the arena ({}) can be locked for RDMA registration",
            ApproxSize(cfg.arena_bytes)
        )),
        (Isolation::Shared, Some(why)) => f.problem(format!(
            "registering the {} arena for RDMA pins it, and {why}",
            ApproxSize(cfg.arena_bytes)
        )),
        (Isolation::Lease, Some(why)) => f.warn(format!(
            "each RDMA lease pins its slot (up to the {} arena), and {why}: \
             leases past the limit get no RDMA key and move their payload by TCP",
            ApproxSize(cfg.arena_bytes)
        )),
    }
}

/// The store's files as a start reads them, and the epochs file.
fn check_store(f: &mut Findings, store: &StoreConfig, specs: &[VolumeSpec]) {
    match Store::check(store, specs) {
        Ok(c) => {
            f.ok(c.summary);
            for w in c.warnings {
                f.warn(w);
            }
        }
        Err(e) => f.problem(format!(
            "the store in swap_dir: {e} (a start refuses it; see arenad --repair in docs/OPERATIONS.md)"
        )),
    }
    match Epochs::open(&store.dir) {
        Ok(_) => f.ok(format!(
            "the volumes' epochs file in {} is readable (or absent: every volume at epoch 0)",
            store.dir.display()
        )),
        Err(e) => f.problem(e.to_string()),
    }
}
