//! A full filesystem under `swap_dir` keeps FLUSH working for everything
//! that fits in the swap file, and lets the real `arenad` restart: the test
//! makes a small ext4 on a loop device, starts arenad on it, fills the
//! filesystem to the last block, then writes and flushes through arenad.
//!
//! Needs root and loop devices (this machine and CI run tests as root). Where
//! they are missing the test fails saying so; `UBLK_TEST_NO_LOOP=1` skips it
//! explicitly, with a warning.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::arenad::{kill9, terminate, Arenad};
use common::*;
use futures::executor::block_on;
use target_rdma::blob::ArenaError;
use target_rdma::proto::Status;

const BLOB: usize = 64 << 10;

/// A loop-mounted ext4, unmounted (and its loop device freed) on drop;
/// declared before any arenad of the test, so it is dropped after them.
struct LoopFs {
    mnt: PathBuf,
}

impl LoopFs {
    fn new(dir: &Path, mib: u64) -> Result<LoopFs, String> {
        let run = |cmd: &mut Command| -> Result<(), String> {
            let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "{cmd:?}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ))
            }
        };
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not running as root".into());
        }
        run(Command::new("losetup").arg("-f"))?;
        let img = dir.join("fs.img");
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(mib << 20))
            .map_err(|e| format!("creating {}: {e}", img.display()))?;
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&img))?;
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt).map_err(|e| e.to_string())?;
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(&mnt))?;
        Ok(LoopFs { mnt })
    }

    /// Fails unless a new 4 KiB file cannot be written.
    fn assert_full(&self) {
        let r = std::fs::write(self.mnt.join("probe"), [1u8; 4096])
            .and_then(|()| std::fs::File::open(self.mnt.join("probe"))?.sync_all());
        let _ = std::fs::remove_file(self.mnt.join("probe"));
        assert!(
            matches!(&r, Err(e) if e.raw_os_error() == Some(libc::ENOSPC)),
            "the filesystem is not full: {r:?}"
        );
    }

    /// Writes a file until the filesystem refuses more.
    fn fill(&self) {
        let mut f = std::fs::File::create(self.mnt.join("filler")).unwrap();
        let chunk = vec![0xa5u8; 64 << 10];
        loop {
            match f.write_all(&chunk).and_then(|()| f.sync_data()) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => panic!("filling the filesystem: {e}"),
            }
        }
        // Whatever is left is smaller than a 64 KiB chunk: take it too.
        let small = [0u8; 1024];
        while f.write_all(&small).and_then(|()| f.sync_data()).is_ok() {}
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
    }
}

#[test]
fn a_full_filesystem_keeps_flush_working_and_arenad_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let fs = match LoopFs::new(dir.path(), 48) {
        Ok(fs) => fs,
        Err(why) if std::env::var_os("UBLK_TEST_NO_LOOP").is_some() => {
            eprintln!("WARNING: full-disk test SKIPPED (UBLK_TEST_NO_LOOP is set): {why}");
            return;
        }
        Err(why) => panic!(
            "the full-disk test needs root and a loop device for a small ext4 ({why}); \
             run tests as root, or set UBLK_TEST_NO_LOOP=1 to skip it knowingly"
        ),
    };
    // 256 extents of 64 KiB in a 48 MiB filesystem, arena of 16 slots.
    let p = Arenad::new(dir.path(), "1M", "64K", "16M", Some(&fs.mnt.join("swap")));
    let child = p.start();
    fs.fill();
    fs.assert_full();

    let c = p.connect("a");
    let mut flushed = 0u64;
    let no_space = block_on(async {
        for k in 0u64.. {
            match c.write(k, 0, &pattern(k, 1, BLOB)).await {
                Ok(()) => {}
                Err(e) => return (k, e),
            }
            if k % 16 == 15 {
                c.flush().await.expect("FLUSH on a full filesystem");
                flushed = k + 1;
            }
        }
        unreachable!()
    });
    // Swap is the capacity (one extent stays spare); the filesystem never
    // got in the way.
    let (stopped_at, e) = no_space;
    assert!(
        matches!(
            e,
            ArenaError::Status {
                status: Status::NoSpace,
                ..
            }
        ),
        "writes stop only when swap is full, got {e} at key {stopped_at}"
    );
    assert!(stopped_at >= 250, "only {stopped_at} blobs fit");
    block_on(c.flush()).expect("FLUSH of everything that fits");
    flushed = flushed.max(stopped_at);
    drop(c);

    // A crash and a clean stop, both restarting on the full filesystem.
    kill9(child);
    fs.assert_full();
    let child = p.start();
    let c = p.connect("a");
    let mut out = vec![0; BLOB];
    for k in 0..flushed {
        assert!(block_on(c.read_found(k, 0, &mut out)).unwrap(), "key {k}");
        assert!(out == pattern(k, 1, BLOB), "key {k} differs");
    }
    block_on(async {
        c.write(0, 0, &pattern(0, 2, BLOB)).await.unwrap();
        c.flush().await.unwrap();
    });
    drop(c);
    terminate(child);
    let child = p.start();
    let c = p.connect("a");
    assert!(block_on(c.read_found(0, 0, &mut out)).unwrap());
    assert!(out == pattern(0, 2, BLOB), "rewrite after restart lost");
    drop(c);
    kill9(child);
}
