//! Device definitions: what `ublkctl add` asked for, persisted as
//! `<state_dir>/devices/<id>.json` so a restarted `ublkd` brings the same
//! devices back, and what they mean to the kernel (ublk parameters) and to
//! the metrics (the device's shape).

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use libublk::sys;
use serde::{Deserialize, Serialize};
use ublk_metrics::events;

use super::DeviceError;
use crate::config::TransportChoice;
use crate::observability::DeviceShape;

/// A device definition, persisted as `<state_dir>/devices/<id>.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSpec {
    /// ublk device id.
    pub id: u32,
    /// `host:port` of `arenad`.
    pub peer: String,
    /// Volume name.
    pub volume: String,
    /// Secret file, read again at every start so rotation needs no re-add.
    pub secret_file: PathBuf,
    /// Size in bytes.
    pub size: u64,
    /// Hardware queues.
    pub queues: u32,
    /// Queue depth.
    pub depth: u32,
    /// Per-request buffer.
    pub io_buf: u64,
    /// Blob size asked for (0: the volume's).
    pub blob_size: u64,
    /// TransportChoice asked for.
    pub transport: TransportChoice,
    /// Confidential (`add --confidential`, `[device] confidential`): every
    /// session speaks protocol version 3, whose frame bodies are sealed
    /// with AES-256-GCM, and none moves payloads by RDMA (in the clear).
    /// Not written when false, so a definition from before the key reads,
    /// and is written back, unchanged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub confidential: bool,
    /// Logical block size.
    pub logical_block_size: u32,
    /// Physical block size.
    pub physical_block_size: u32,
    /// Largest request.
    pub max_io_size: u64,
    /// DISCARD advertised.
    pub discard: bool,
    /// Largest DISCARD.
    pub max_discard_size: u64,
    /// WRITE_ZEROES advertised.
    pub write_zeroes: bool,
    /// Largest WRITE_ZEROES.
    pub max_write_zeroes_size: u64,
    /// Volatile write cache advertised.
    pub write_cache: bool,
    /// FUA advertised.
    pub fua: bool,
    /// Read-only to its users (`add --read-only`).
    #[serde(default)]
    pub read_only: bool,
    /// CPUs the queue threads are pinned to, queue q on `cpus[q % len]`
    /// (`add --cpus`); empty keeps the kernel's queue mapping.
    #[serde(default)]
    pub cpus: Vec<u32>,
    /// A replicated volume: its members. Absent for a volume on one peer
    /// (`peer`), whose definition then has no `replicas` field at all
    /// (not written, and not needed when read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<ReplicaSpec>,
}

/// The replica set a replicated device was created with. After that the
/// membership record (etcd, or the state dir without it) is authoritative:
/// a restarted ublkd serves the members it names.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaSpec {
    /// The members at creation, as the record names them: `host:port`
    /// (`add --peer`), or placement-pool ids (placed by etcd).
    pub peers: Vec<String>,
    /// Served without the writer role (kept up to date as the role moves,
    /// so a restarted ublkd comes back in the role it had).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub standby: bool,
    /// A standby's first write takes the role.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub activate_on_write: bool,
}

/// Reads and writes device definitions.
#[derive(Clone)]
pub struct SpecStore {
    dir: PathBuf,
}

impl SpecStore {
    /// The store under `<state_dir>/devices`, created if missing.
    pub fn open(state_dir: &Path) -> Result<Self, DeviceError> {
        let dir = state_dir.join("devices");
        fs::create_dir_all(&dir).map_err(|source| DeviceError::State {
            path: dir.clone(),
            source,
        })?;
        Ok(Self { dir })
    }

    /// The store under `<state_dir>/devices`, without creating anything
    /// (`--check-config`).
    pub fn read_only(state_dir: &Path) -> Result<Self, DeviceError> {
        Ok(Self {
            dir: state_dir.join("devices"),
        })
    }

    /// How many definitions parse, and the ones that do not with why.
    pub fn check_all(&self) -> Result<(usize, Vec<(PathBuf, String)>), DeviceError> {
        let mut good = 0;
        let mut bad = Vec::new();
        for path in self.files()? {
            match read_spec(&path) {
                Ok(_) => good += 1,
                Err(e) => bad.push((path, e)),
            }
        }
        Ok((good, bad))
    }

    fn files(&self) -> Result<Vec<PathBuf>, DeviceError> {
        let rd = fs::read_dir(&self.dir).map_err(|source| DeviceError::State {
            path: self.dir.clone(),
            source,
        })?;
        Ok(rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect())
    }

    fn path(&self, id: u32) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Writes atomically (temp file, fsync, rename) so a crash never
    /// leaves a half-written definition behind.
    pub fn save(&self, spec: &DeviceSpec) -> Result<(), DeviceError> {
        let path = self.path(spec.id);
        let tmp = self.dir.join(format!(".{}.json.tmp", spec.id));
        let err = |source| DeviceError::State {
            path: path.clone(),
            source,
        };
        let mut f = fs::File::create(&tmp).map_err(err)?;
        let text = serde_json::to_string_pretty(spec).map_err(|e| err(e.into()))?;
        f.write_all(text.as_bytes()).map_err(err)?;
        f.sync_all().map_err(err)?;
        fs::rename(&tmp, &path).map_err(err)?;
        fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(err)
    }

    /// Deletes a definition; a missing one is fine.
    pub fn remove(&self, id: u32) -> Result<(), DeviceError> {
        match fs::remove_file(self.path(id)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(DeviceError::State {
                path: self.path(id),
                source: e,
            }),
            _ => Ok(()),
        }
    }

    /// Every readable definition; unreadable ones are logged and skipped
    /// so one bad file does not keep the other devices down.
    pub fn load_all(&self) -> Result<Vec<DeviceSpec>, DeviceError> {
        let mut specs = Vec::new();
        for path in self.files()? {
            match read_spec(&path) {
                Ok(s) => specs.push(s),
                Err(e) => {
                    tracing::error!(event = events::DEVICE_SPEC_UNREADABLE, path = %path.display(), error = %e)
                }
            }
        }
        specs.sort_by_key(|s| s.id);
        Ok(specs)
    }
}

fn read_spec(path: &Path) -> Result<DeviceSpec, String> {
    fs::read_to_string(path)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str::<DeviceSpec>(&t).map_err(|e| e.to_string()))
}

/// Why a confidential device asked for `auto` serves TCP (`ublkctl show`'s
/// `tcp because`).
pub const CONFIDENTIAL_TCP: &str = "confidential: payloads stay on the sealed TCP stream";

impl DeviceSpec {
    /// Refuses what cannot be served as asked: a confidential volume on
    /// `transport = rdma` (RDMA moves payloads in the clear, and a
    /// confidential session offers none).
    pub fn check_transport(&self) -> Result<(), DeviceError> {
        if self.confidential && self.transport == TransportChoice::Rdma {
            return Err(DeviceError::BadRequest(
                "--confidential keeps payloads on the sealed TCP stream, and RDMA moves them \
                 in the clear: use --transport tcp or auto"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The transport the device's sessions are opened on: a confidential
    /// device's `auto` is TCP (no RDMA provider is opened at all).
    pub fn effective_transport(&self) -> TransportChoice {
        match self.transport {
            TransportChoice::Auto if self.confidential => TransportChoice::Tcp,
            t => t,
        }
    }

    /// Why the device serves TCP when its transport asked for RDMA where
    /// it can (`auto`), given the reason its sessions gave (`negotiated`):
    /// a confidential device's is its confidentiality.
    pub fn transport_note(&self, negotiated: Option<String>) -> Option<String> {
        match self.transport {
            TransportChoice::Auto if self.confidential => Some(CONFIDENTIAL_TCP.into()),
            _ => negotiated,
        }
    }
}

pub(super) fn shape(spec: &DeviceSpec) -> DeviceShape {
    DeviceShape {
        id: spec.id,
        // Bounded by check_geometry (at most MAX_QUEUES / MAX_DEPTH).
        queues: spec.queues as u16,
        depth: spec.depth as u16,
        transport: spec.transport,
    }
}

/// ublk parameters for a spec.
pub(super) fn params(spec: &DeviceSpec) -> sys::ublk_params {
    let shift = |v: u64| v.trailing_zeros() as u8;
    let mut attrs = 0;
    if spec.write_cache {
        attrs |= sys::UBLK_ATTR_VOLATILE_CACHE;
    }
    if spec.fua {
        attrs |= sys::UBLK_ATTR_FUA;
    }
    if spec.read_only {
        attrs |= sys::UBLK_ATTR_READ_ONLY;
    }
    let mut p = sys::ublk_params {
        types: sys::UBLK_PARAM_TYPE_BASIC,
        basic: sys::ublk_param_basic {
            attrs,
            logical_bs_shift: shift(spec.logical_block_size.into()),
            physical_bs_shift: shift(spec.physical_block_size.into()),
            io_opt_shift: shift(spec.physical_block_size.into()),
            io_min_shift: shift(spec.logical_block_size.into()),
            max_sectors: (spec.max_io_size >> 9) as u32,
            dev_sectors: spec.size >> 9,
            ..Default::default()
        },
        ..Default::default()
    };
    if spec.discard || spec.write_zeroes {
        p.types |= sys::UBLK_PARAM_TYPE_DISCARD;
        p.discard = sys::ublk_param_discard {
            discard_alignment: 0,
            discard_granularity: spec.physical_block_size,
            max_discard_sectors: if spec.discard {
                (spec.max_discard_size >> 9) as u32
            } else {
                0
            },
            max_write_zeroes_sectors: if spec.write_zeroes {
                (spec.max_write_zeroes_size >> 9) as u32
            } else {
                0
            },
            max_discard_segments: 1,
            ..Default::default()
        };
    }
    p
}
