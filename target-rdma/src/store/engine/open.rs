//! Opening the engine: the state of a found store rebuilt from its index,
//! every extent the index names checked against its header, or the files
//! of a new store created. Runs before any other thread sees the state.

use std::collections::{BTreeMap, HashMap};
use ublk_metrics::events;

use super::background::Background;
use super::blob::{Blob, Placed};
use super::durable::Durable;
use super::images::Images;
use super::lease::Leases;
use super::read_ahead::ReadAhead;
use super::slots::Slots;
use super::state::{Counters, State};
use super::transit::Transit;
use super::volumes::{names, Volume, Volumes};
use crate::store::arena::Arena;
use crate::store::config::{StoreConfig, VolumeSpec};
use crate::store::disk::StoreDir;
use crate::store::error::StoreError;
use crate::store::extent::{self, Ident, BLOCK};
use crate::store::format::Snapshot;
use crate::store::index::{Found, Index};
use crate::store::swap::{Extents, Swap};

/// Most damaged extents logged one by one at open; the rest are counted.
const DAMAGE_LOGGED: usize = 16;

/// Builds the state of a found store (or a new one when `found` is
/// `None`) and opens its swap; checks every extent the index names
/// against its header, marking the blobs whose header fails.
pub(in crate::store) fn open(
    dir: &StoreDir,
    cfg: &StoreConfig,
    arena: &Arena,
    slots: u32,
    extents: u32,
    specs: &[VolumeSpec],
    found: Option<Found>,
) -> Result<(State, Swap), StoreError> {
    let mut volumes: Vec<Volume> = specs
        .iter()
        .map(|v| Volume {
            name: v.name.clone(),
            quota: v.quota_blobs,
            blobs: 0,
            resident: 0,
            on_swap: 0,
            served: true,
        })
        .collect();
    let mut by_name: HashMap<String, u32> = (0..volumes.len() as u32)
        .map(|i| (volumes[i as usize].name.clone(), i))
        .collect();
    let mut blobs = BTreeMap::new();
    let mut used = vec![false; extents as usize];
    let blocks = cfg.blob_bytes as usize / BLOCK;
    let (generation, swap) = match &found {
        None => (
            1,
            Swap::create(
                dir,
                cfg.blob_bytes,
                extents,
                cfg.swap_reads_in_flight,
                &mut arena.write(0),
            )?,
        ),
        Some(f) => {
            let img = &f.image;
            let ids: Vec<u32> = img
                .volumes
                .iter()
                .map(|name| {
                    *by_name.entry(name.clone()).or_insert_with(|| {
                        tracing::warn!(event = events::VOLUME_NOT_CONFIGURED, volume = %name, "keeping the blobs of a persisted volume that is no longer configured");
                        volumes.push(Volume { name: name.clone(), quota: 0, blobs: 0, resident: 0, on_swap: 0, served: false });
                        (volumes.len() - 1) as u32
                    })
                })
                .collect();
            for (&(pv, key), &(extent, version)) in &img.blobs {
                let vol = ids[pv as usize];
                // The load saw to it that no extent is mapped twice.
                used[extent as usize] = true;
                volumes[vol as usize].blobs += 1;
                volumes[vol as usize].on_swap += 1;
                let placed = Some(Placed { extent, version });
                blobs.insert(
                    (vol, key),
                    Blob {
                        slot: None,
                        extent: placed,
                        durable: placed,
                        damaged: None,
                    },
                );
            }
            let swap = Swap::open(
                dir,
                cfg.blob_bytes,
                img.extents,
                extents,
                cfg.swap_reads_in_flight,
                &mut arena.write(0),
            )?;
            (img.generation + 1, swap)
        }
    };
    let vol_ids: Vec<u64> = volumes.iter().map(|v| extent::volume_id(&v.name)).collect();
    let mut crcs = vec![0u32; extents as usize * blocks];
    if let Some(highest) = blobs
        .values()
        .filter_map(|b: &Blob| b.durable)
        .map(|p| p.extent)
        .max()
    {
        let records = swap.meta().read_all(highest + 1)?;
        let mut damaged = 0usize;
        for (&(vol, key), b) in blobs.iter_mut() {
            let Some(p) = b.durable else { continue };
            let want = Ident {
                volume: vol_ids[vol as usize],
                key,
                version: p.version,
            };
            let name = |id: u64| {
                vol_ids.iter().position(|&v| v == id).map_or_else(
                    || format!("{id:#018x}"),
                    |i| format!("{:?}", volumes[i].name),
                )
            };
            let why = match extent::verify(&records[p.extent as usize], &want, name) {
                Ok(c) => {
                    let at = p.extent as usize * blocks;
                    crcs[at..at + blocks].copy_from_slice(c);
                    continue;
                }
                Err(why) => why,
            };
            if damaged < DAMAGE_LOGGED {
                tracing::warn!(event = events::SWAP_EXTENT_HEADER_INVALID, file = %swap.meta().path().display(), extent = p.extent, volume = %volumes[vol as usize].name, key, detail = %why, "a blob's swap image does not match its header: its reads fail until it is rewritten, removed or repaired");
            }
            damaged += 1;
            b.damaged = Some(why.into_boxed_str());
        }
        if damaged > DAMAGE_LOGGED {
            tracing::warn!(event = events::SWAP_EXTENT_HEADERS_INVALID, file = %swap.meta().path().display(), count = damaged, "more blobs whose swap image does not match its header");
        }
    }
    let meta = swap.meta_handle();
    let index = {
        let names = names(&volumes);
        let snap = Snapshot {
            generation,
            blob_bytes: cfg.blob_bytes,
            extents,
            volumes: &names,
            blob_count: blobs.len() as u64,
            blobs: blobs
                .iter()
                .filter_map(|(k, b)| b.durable.map(|d| (k.0, k.1, d.extent, d.version))),
        };
        match found {
            None => Index::create(dir, extents, snap)?,
            Some(f) => Index::reopen(dir, f, extents, snap)?,
        }
    };
    let state = State {
        blob_bytes: cfg.blob_bytes,
        generation,
        seq: 0,
        volumes: Volumes::new(volumes, vol_ids),
        blobs,
        slots: Slots::new(slots),
        leases: Leases::new(),
        images: Images::new(Extents::new(extents, &used), meta, crcs, blocks),
        durable: Durable::new(index),
        counters: Counters::default(),
        transit: Transit::default(),
        background: Background::default(),
        read_ahead: ReadAhead::default(),
    };
    Ok((state, swap))
}
