//! Volume secrets and the HELLO challenge-response.
//!
//! The secret never crosses the wire: the server sends a fresh nonce, the
//! client answers with an HMAC-SHA256 over the whole handshake transcript,
//! and the server proves knowledge of the same secret in its reply, so a
//! client cannot be lured into talking to an impostor either. Tags are
//! compared in constant time by `hmac`'s `verify_slice`.

use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::proto::{Challenge, Hello, Welcome, MAC_LEN};

/// Shortest secret accepted: 128 bits.
pub const MIN_SECRET_LEN: usize = 16;
/// Longest secret accepted, so a wrong path cannot make us slurp a huge file.
pub const MAX_SECRET_LEN: usize = 4096;

/// A volume secret. Its `Debug` output is redacted so it cannot reach a log.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Why a secret file was refused.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The file could not be read.
    #[error("secret file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Group or others may read the file.
    #[error("secret file {path} has mode {mode:04o}: it must not be accessible by group or others (chmod 600)")]
    Permissions {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Too short or too long after trimming whitespace.
    #[error("secret file {path} holds {len} bytes: a secret must be {MIN_SECRET_LEN}..={MAX_SECRET_LEN} bytes")]
    Length {
        /// The file.
        path: PathBuf,
        /// Bytes after trimming.
        len: usize,
    },
}

impl Secret {
    /// Wraps secret bytes, enforcing the length bounds.
    pub fn new(bytes: Vec<u8>) -> Result<Self, SecretError> {
        if !(MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&bytes.len()) {
            return Err(SecretError::Length {
                path: PathBuf::from("<inline>"),
                len: bytes.len(),
            });
        }
        Ok(Self(bytes))
    }

    /// Reads a secret file: mode must deny group and others, surrounding
    /// whitespace (a trailing newline from `echo`) is not part of the secret.
    pub fn from_file(path: &Path) -> Result<Self, SecretError> {
        let read_err = |source| SecretError::Read {
            path: path.to_owned(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(read_err)?;
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(SecretError::Permissions {
                path: path.to_owned(),
                mode,
            });
        }
        if meta.len() > MAX_SECRET_LEN as u64 * 2 {
            return Err(SecretError::Length {
                path: path.to_owned(),
                len: meta.len() as usize,
            });
        }
        let raw = std::fs::read(path).map_err(read_err)?;
        let trimmed = raw.trim_ascii();
        Self::new(trimmed.to_vec()).map_err(|_| SecretError::Length {
            path: path.to_owned(),
            len: trimmed.len(),
        })
    }

    /// Whether two secrets are the same bytes (a reload telling a rotated
    /// secret from an unchanged one). Both are ours, so the comparison
    /// needs no constant time.
    pub fn same_as(&self, other: &Secret) -> bool {
        self.0 == other.0
    }

    fn mac(&self, label: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut m = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(label);
        for p in parts {
            m.update(&(p.len() as u32).to_le_bytes());
            m.update(p);
        }
        m
    }

    fn client_mac(&self, ch: &Challenge, h: &Hello) -> Hmac<Sha256> {
        self.mac(
            b"arena-v1 client",
            &[
                &h.version.to_le_bytes(),
                &h.caps.to_le_bytes(),
                &h.blob_bytes.to_le_bytes(),
                &ch.server_nonce,
                &h.client_nonce,
                h.volume.as_bytes(),
            ],
        )
    }

    fn server_mac(&self, ch: &Challenge, h: &Hello, w: &Welcome) -> Hmac<Sha256> {
        self.mac(
            b"arena-v1 server",
            &[
                &w.session_id.to_le_bytes(),
                &w.generation.to_le_bytes(),
                &w.blob_bytes.to_le_bytes(),
                &w.caps.to_le_bytes(),
                &w.quota_blobs.to_le_bytes(),
                &ch.server_nonce,
                &h.client_nonce,
                h.volume.as_bytes(),
            ],
        )
    }

    /// The tag a client puts in its HELLO (whose `mac` field is ignored).
    pub fn sign_hello(&self, ch: &Challenge, h: &Hello) -> [u8; MAC_LEN] {
        self.client_mac(ch, h).finalize().into_bytes().into()
    }

    /// Checks a HELLO's tag in constant time.
    pub fn verify_hello(&self, ch: &Challenge, h: &Hello) -> bool {
        self.client_mac(ch, h).verify_slice(&h.mac).is_ok()
    }

    /// The tag a server puts in its WELCOME (whose `mac` field is ignored).
    pub fn sign_welcome(&self, ch: &Challenge, h: &Hello, w: &Welcome) -> [u8; MAC_LEN] {
        self.server_mac(ch, h, w).finalize().into_bytes().into()
    }

    /// Checks a WELCOME's tag in constant time.
    pub fn verify_welcome(&self, ch: &Challenge, h: &Hello, w: &Welcome) -> bool {
        self.server_mac(ch, h, w).verify_slice(&w.mac).is_ok()
    }
}

/// A fresh random nonce from the OS-seeded CSPRNG.
pub fn nonce() -> [u8; crate::proto::NONCE_LEN] {
    rand::random()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{CAP_TCP_DATA, NONCE_LEN};
    use std::io::Write;

    fn secret(s: &str) -> Secret {
        Secret::new(s.as_bytes().to_vec()).unwrap()
    }

    fn transcript() -> (Challenge, Hello, Welcome) {
        let ch = Challenge {
            min_version: 1,
            max_version: 1,
            server_nonce: nonce(),
            max_inflight: 64,
            max_inline: 1 << 20,
        };
        let h = Hello {
            version: 1,
            caps: CAP_TCP_DATA,
            blob_bytes: 0,
            client_nonce: nonce(),
            mac: [0; MAC_LEN],
            volume: "vm1".into(),
        };
        let w = Welcome {
            session_id: 1,
            generation: 3,
            blob_bytes: 1 << 20,
            caps: CAP_TCP_DATA,
            quota_blobs: 10,
            mac: [0; MAC_LEN],
        };
        (ch, h, w)
    }

    #[test]
    fn matching_secrets_authenticate_both_ways() {
        let (ch, mut h, mut w) = transcript();
        let s = secret("correct horse battery staple");
        h.mac = s.sign_hello(&ch, &h);
        assert!(s.verify_hello(&ch, &h));
        w.mac = s.sign_welcome(&ch, &h, &w);
        assert!(s.verify_welcome(&ch, &h, &w));
    }

    #[test]
    fn wrong_secret_tampering_and_replay_fail() {
        let (ch, mut h, _) = transcript();
        h.mac = secret("correct horse battery staple").sign_hello(&ch, &h);
        assert!(!secret("wrong horse battery staple!").verify_hello(&ch, &h));

        let s = secret("correct horse battery staple");
        let mut other_volume = h.clone();
        other_volume.volume = "vm2".into();
        assert!(!s.verify_hello(&ch, &other_volume));

        let mut replay = ch.clone();
        replay.server_nonce = [0; NONCE_LEN];
        assert!(!s.verify_hello(&replay, &h));
    }

    #[test]
    fn secret_files_must_be_private_and_sized() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm1.key");
        let mut f = std::fs::File::create(&path).unwrap();
        writeln!(f, "0123456789abcdef0123").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Secret::from_file(&path).unwrap_err().to_string();
        assert!(e.contains("mode 0644") && e.contains("chmod 600"), "{e}");

        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Secret::from_file(&path).is_ok());

        std::fs::write(&path, "short\n").unwrap();
        let e = Secret::from_file(&path).unwrap_err().to_string();
        assert!(e.contains("holds 5 bytes"), "{e}");

        let e = Secret::from_file(&dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing"), "{e}");
    }

    #[test]
    fn debug_output_is_redacted() {
        assert_eq!(
            format!("{:?}", secret("correct horse battery staple")),
            "Secret(<redacted>)"
        );
    }
}
