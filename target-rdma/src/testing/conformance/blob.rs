//! One suite, every `BlobIo`: each transport, session and replicated
//! volume must behave the same, failures included: the same failure is the
//! same `ArenaError` kind and status over every one of them.
//!
//! A backend runs it over volume "a" of a store sized by [`store_config`]
//! (or of a [`Peer`](crate::testing::Peer) started with [`peer_opts`]):
//! blobs of [`BLOB`] bytes, a 16-slot arena, a quota of [`QUOTA`] blobs.

use std::path::Path;

use futures::executor::block_on;
use futures::future::join_all;

use crate::blob::{BlobIo, ErrorKind, Transport, Via};
use crate::proto::Status;
use crate::store::{StoreConfig, VolumeSpec};
use crate::testing::{pattern, PeerOpts};

/// Blob size of the suite's volume.
pub const BLOB: u32 = 64 << 10;
/// Blobs the volume may hold: more than any case writes but one.
pub const QUOTA: u64 = 48;
/// RAM arena: 16 blobs, fewer than the cases write, so they evict.
pub const ARENA_BYTES: u64 = 1 << 20;

/// A store for the suite in `dir`, and its volume "a".
pub fn store_config(dir: &Path) -> (StoreConfig, Vec<VolumeSpec>) {
    super::store_of_volume_a(dir, BLOB, ARENA_BYTES, QUOTA)
}

/// An arena peer for the suite (volume "a" is the one the cases use).
pub fn peer_opts() -> PeerOpts {
    PeerOpts {
        arena_bytes: ARENA_BYTES,
        blob_bytes: BLOB,
        quota_blobs: QUOTA,
        ..PeerOpts::default()
    }
}

/// The path a backend's payloads take (every backend under the suite
/// moves every payload on its own data path).
fn via(io: &impl BlobIo) -> Via {
    match io.transport() {
        Transport::InProcess => Via::InProcess,
        Transport::Tcp => Via::Tcp,
        Transport::Rdma => Via::Rdma,
    }
}

/// An unwritten blob reads as zeros, and the read moved no payload.
pub fn unwritten_blobs_read_as_zeros(io: &impl BlobIo) {
    let mut out = vec![0xaa; 4096];
    assert_eq!(block_on(io.read(5, 100, &mut out)).unwrap(), Via::Nothing);
    assert!(out.iter().all(|b| *b == 0));
}

/// A write inside a blob changes those bytes only.
pub fn partial_writes_keep_the_rest_of_the_blob(io: &impl BlobIo) {
    block_on(async {
        assert_eq!(io.write(1, 0, &[1; 1000]).await.unwrap(), via(io));
        assert_eq!(io.write(1, 500, &[2; 100]).await.unwrap(), via(io));
        let mut out = vec![0; 2000];
        assert_eq!(io.read(1, 0, &mut out).await.unwrap(), via(io));
        assert!(out[..500].iter().all(|b| *b == 1));
        assert!(out[500..600].iter().all(|b| *b == 2));
        assert!(out[600..1000].iter().all(|b| *b == 1));
        assert!(out[1000..].iter().all(|b| *b == 0));
    });
}

/// 40 blobs through a 16-slot arena: eviction and fault-in on every pass.
pub fn whole_blobs_round_trip_beyond_the_arena(io: &impl BlobIo) {
    block_on(async {
        for key in 0..40 {
            io.write(key, 0, &pattern(key, 1, BLOB as usize))
                .await
                .unwrap();
        }
        let mut out = vec![0; BLOB as usize];
        for key in (0..40).rev() {
            assert_eq!(io.read(key, 0, &mut out).await.unwrap(), via(io));
            assert!(out == pattern(key, 1, BLOB as usize), "blob {key} differs");
        }
    });
}

/// REMOVE drops the blobs of its range, no others, and counts them.
pub fn remove_drops_exactly_the_range(io: &impl BlobIo) {
    block_on(async {
        for key in 0..10 {
            io.write(key, 0, &[key as u8 + 1; 16]).await.unwrap();
        }
        assert_eq!(io.remove(3, 7).await.unwrap(), 4);
        assert_eq!(io.remove(3, 7).await.unwrap(), 0);
        let mut out = [0u8; 16];
        for key in 0..10 {
            let present = io.read(key, 0, &mut out).await.unwrap().moved();
            assert_eq!(present, !(3..7).contains(&key), "key {key}");
        }
    });
}

/// A range past the blob's end is a protocol error naming the offset, and
/// the session goes on serving.
pub fn ranges_past_the_blob_end_are_refused(io: &impl BlobIo) {
    for (offset, len) in [(BLOB - 10, 11), (BLOB, 1), (u32::MAX, 1)] {
        let e = block_on(io.write(1, offset, &vec![0; len])).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Status(Status::Protocol), "{e}");
        assert!(e.to_string().contains(&offset.to_string()), "{e}");
        let e = block_on(io.read(1, offset, &mut vec![0; len])).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Status(Status::Protocol), "{e}");
    }
    // The session survives its refused requests.
    block_on(io.write(1, 0, &[1; 16])).unwrap();
}

/// At its quota a volume refuses a new blob with `QUOTA_EXCEEDED`, still
/// takes writes to the blobs it holds, and a removed blob makes room.
pub fn a_volume_at_its_quota_refuses_new_blobs_but_not_old_ones(io: &impl BlobIo) {
    block_on(async {
        for key in 0..QUOTA {
            io.write(key, 0, &[key as u8; 512]).await.unwrap();
        }
        let e = io.write(QUOTA, 0, &[1; 512]).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Status(Status::QuotaExceeded), "{e}");
        assert_eq!(e.status(), Some(Status::QuotaExceeded));
        io.write(3, 512, &[9; 512]).await.unwrap();
        assert_eq!(io.remove(0, 1).await.unwrap(), 1);
        io.write(QUOTA, 0, &[7; 512]).await.unwrap();
        let mut out = [0u8; 512];
        assert!(io.read(QUOTA, 0, &mut out).await.unwrap().moved());
        assert_eq!(out, [7; 512]);
    });
}

/// 32 writes in flight at once, a flush, and each blob reads back its own.
pub fn concurrent_writes_to_many_keys(io: &impl BlobIo) {
    block_on(async {
        let writes = (0..32u64).map(|k| async move { io.write(k, 8, &pattern(k, 7, 3000)).await });
        for r in join_all(writes).await {
            r.unwrap();
        }
        io.flush().await.unwrap();
        let mut out = vec![0; 3000];
        for k in 0..32 {
            io.read(k, 8, &mut out).await.unwrap();
            assert!(out == pattern(k, 7, 3000), "blob {k} differs");
        }
    });
}
