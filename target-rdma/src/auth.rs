//! Volume secrets, the HELLO challenge-response, and the keys that protect
//! every frame after it (a tag in protocol version 2, AES-256-GCM sealing in
//! version 3).
//!
//! The secret never crosses the wire: the server sends a fresh nonce, the
//! client answers with an HMAC-SHA256 over the whole handshake transcript,
//! and the server proves knowledge of the same secret in its reply, so a
//! client cannot be lured into talking to an impostor either. Tags are
//! compared in constant time by `hmac`'s `verify_slice`.
//!
//! After a version-2 or -3 handshake each direction has a key of its own,
//! derived from the secret and both nonces ([`Secret::session_keys`]), and
//! every frame carries a tag bound to its sequence number in that
//! direction, its header and its body: a frame cannot be injected,
//! replayed, reordered or dropped without the receiver noticing. Version 2
//! tags with keyed BLAKE3 ([`TagKey`]) and leaves the body readable;
//! version 3 seals the body with AES-256-GCM ([`SealKey`]), so it also
//! hides it.

use std::fmt;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use ring::aead;
use sha2::Sha256;

use crate::proto::{Challenge, Hello, Welcome, HEADER_LEN, MAC_LEN, TAG_LEN, VERSION_2, VERSION_3};

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
    /// Not a regular file (a FIFO would block the reader forever, a device
    /// or directory is a wrong path).
    #[error("secret file {path} is {kind}, not a regular file")]
    NotRegular {
        /// The file.
        path: PathBuf,
        /// What it is instead.
        kind: &'static str,
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

    /// Reads a secret file. It must be a regular file (a symlink to one is
    /// followed) whose mode denies group and others. The secret is the
    /// file's bytes with leading and trailing ASCII whitespace (space, tab,
    /// CR, LF, form feed) removed, nothing else: no decoding, so the text a
    /// `base64` command wrote is the secret, as text.
    pub fn from_file(path: &Path) -> Result<Self, SecretError> {
        let read_err = |source| SecretError::Read {
            path: path.to_owned(),
            source,
        };
        // Refuse what is not a regular file before opening it, then check
        // again what was opened (it may have been swapped in between);
        // O_NONBLOCK keeps the open itself from waiting on a FIFO.
        not_regular(path, &std::fs::metadata(path).map_err(read_err)?)?;
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(read_err)?;
        let meta = file.metadata().map_err(read_err)?;
        not_regular(path, &meta)?;
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(SecretError::Permissions {
                path: path.to_owned(),
                mode,
            });
        }
        let cap = MAX_SECRET_LEN as u64 * 2;
        if meta.len() > cap {
            return Err(SecretError::Length {
                path: path.to_owned(),
                len: meta.len() as usize,
            });
        }
        let mut raw = Vec::new();
        file.by_ref()
            .take(cap + 1)
            .read_to_end(&mut raw)
            .map_err(read_err)?;
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
        if h.version < u16::from(VERSION_2) {
            return self.mac(
                b"arena-v1 client",
                &[
                    &h.version.to_le_bytes(),
                    &h.caps.to_le_bytes(),
                    &h.blob_bytes.to_le_bytes(),
                    &ch.server_nonce,
                    &h.client_nonce,
                    h.volume.as_bytes(),
                ],
            );
        }
        // Version 2 also covers what the CHALLENGE offered, so neither the
        // version range nor the limits can be altered on the way.
        self.mac(
            b"arena-v2 client",
            &[
                &ch.min_version.to_le_bytes(),
                &ch.max_version.to_le_bytes(),
                &ch.max_inflight.to_le_bytes(),
                &ch.max_inline.to_le_bytes(),
                &h.version.to_le_bytes(),
                &h.caps.to_le_bytes(),
                &h.blob_bytes.to_le_bytes(),
                &h.epoch.to_le_bytes(),
                &ch.server_nonce,
                &h.client_nonce,
                h.volume.as_bytes(),
            ],
        )
    }

    fn server_mac(&self, ch: &Challenge, h: &Hello, w: &Welcome) -> Hmac<Sha256> {
        let v2 = h.version >= u16::from(VERSION_2);
        let (sid, generation, quota) = (
            w.session_id.to_le_bytes(),
            w.generation.to_le_bytes(),
            w.quota_blobs.to_le_bytes(),
        );
        let (blob, caps) = (w.blob_bytes.to_le_bytes(), w.caps.to_le_bytes());
        let (hello_epoch, volume_epoch) = (h.epoch.to_le_bytes(), w.epoch.to_le_bytes());
        let mut parts: Vec<&[u8]> = vec![&sid, &generation, &blob, &caps, &quota];
        if v2 {
            parts.extend([&hello_epoch[..], &volume_epoch[..]]);
        }
        parts.extend([
            &ch.server_nonce[..],
            &h.client_nonce[..],
            h.volume.as_bytes(),
        ]);
        let label: &[u8] = if v2 {
            b"arena-v2 server"
        } else {
            b"arena-v1 server"
        };
        self.mac(label, &parts)
    }

    /// The keys of a version-2 or -3 session opened by this CHALLENGE and
    /// HELLO (the HELLO's version says which): one per direction, from the
    /// secret and both (fresh) nonces, so no two sessions share a key.
    pub fn session_keys(&self, ch: &Challenge, h: &Hello) -> SessionKeys {
        let derive = |label: &[u8]| -> [u8; 32] {
            self.mac(
                label,
                &[&ch.server_nonce, &h.client_nonce, h.volume.as_bytes()],
            )
            .finalize()
            .into_bytes()
            .into()
        };
        if h.version >= u16::from(VERSION_3) {
            return SessionKeys {
                client_to_server: FrameKey::Seal(SealKey::new(&derive(
                    b"arena-v3 frames client->server",
                ))),
                server_to_client: FrameKey::Seal(SealKey::new(&derive(
                    b"arena-v3 frames server->client",
                ))),
            };
        }
        SessionKeys {
            client_to_server: FrameKey::Tag(TagKey(derive(b"arena-v2 frames client->server"))),
            server_to_client: FrameKey::Tag(TagKey(derive(b"arena-v2 frames server->client"))),
        }
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

/// Both directions' frame keys of one version-2 or -3 session.
#[derive(Clone)]
pub struct SessionKeys {
    /// Protects the client's frames.
    pub client_to_server: FrameKey,
    /// Protects the server's frames.
    pub server_to_client: FrameKey,
}

impl fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionKeys(<redacted>)")
    }
}

/// How one direction of a session protects its frames: both put a
/// [`TAG_LEN`]-byte tag after the body; a sealing key also encrypts the
/// body in place.
#[derive(Clone)]
pub enum FrameKey {
    /// Version 2: keyed BLAKE3, the body in the clear.
    Tag(TagKey),
    /// Version 3: AES-256-GCM, the body sealed.
    Seal(SealKey),
}

impl FrameKey {
    /// Makes `body` frame `seq`'s with this header and returns its tag: a
    /// tagging key leaves the body as it is, a sealing key encrypts it.
    pub fn protect(&self, seq: u64, header: &[u8; HEADER_LEN], body: &mut [u8]) -> [u8; TAG_LEN] {
        match self {
            Self::Tag(k) => k.tag(seq, header, &body_digest(&[body])),
            Self::Seal(k) => k.seal(seq, header, body),
        }
    }

    /// Whether `tag` is frame `seq`'s with this header and body (checked
    /// in constant time); a sealing key decrypts `body` in place when it
    /// is, and leaves it unusable when it is not.
    #[must_use]
    pub fn open(
        &self,
        seq: u64,
        header: &[u8; HEADER_LEN],
        body: &mut [u8],
        tag: &[u8; TAG_LEN],
    ) -> bool {
        match self {
            Self::Tag(k) => k.verify(seq, header, &body_digest(&[body]), tag),
            Self::Seal(k) => k.open(seq, header, body, tag),
        }
    }

    /// Whether this key seals bodies (version 3).
    pub fn seals(&self) -> bool {
        matches!(self, Self::Seal(_))
    }
}

/// A version-2 direction's key. A frame's tag is keyed BLAKE3 over a
/// label, the frame's sequence number in its direction (0 for the first
/// frame after the handshake), its 24-byte header and the BLAKE3 digest of
/// its body, cut to [`TAG_LEN`] bytes. Hashing the body apart lets a sender
/// digest a large payload before it knows the frame's place in the stream,
/// and the tag itself costs one compression.
#[derive(Clone)]
pub struct TagKey([u8; 32]);

/// The BLAKE3 digest of a frame body, given in pieces (fixed fields, then a
/// payload sent or received apart).
pub fn body_digest(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    for p in parts {
        h.update(p);
    }
    h.finalize().into()
}

impl TagKey {
    /// The tag of frame `seq` with this header and body digest.
    pub fn tag(&self, seq: u64, header: &[u8; HEADER_LEN], digest: &[u8; 32]) -> [u8; TAG_LEN] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(b"arena-v2 frame");
        h.update(&seq.to_le_bytes());
        h.update(header);
        h.update(digest);
        let full = h.finalize();
        let mut tag = [0; TAG_LEN];
        tag.copy_from_slice(&full.as_bytes()[..TAG_LEN]);
        tag
    }

    /// Whether `tag` is frame `seq`'s, compared in constant time.
    pub fn verify(
        &self,
        seq: u64,
        header: &[u8; HEADER_LEN],
        digest: &[u8; 32],
        tag: &[u8; TAG_LEN],
    ) -> bool {
        let want = self.tag(seq, header, digest);
        let diff = want
            .iter()
            .zip(tag)
            .fold(0u8, |acc, (a, b)| acc | std::hint::black_box(a ^ b));
        diff == 0
    }
}

/// A version-3 direction's key: AES-256-GCM with the frame's header as
/// associated data and its sequence number as the nonce (8 bytes
/// little-endian, then 4 zero bytes). A key serves one direction of one
/// session and the sequence number never repeats in it, so no nonce is
/// used twice under a key.
#[derive(Clone)]
pub struct SealKey(std::sync::Arc<aead::LessSafeKey>);

impl SealKey {
    fn new(key: &[u8; 32]) -> Self {
        let unbound =
            aead::UnboundKey::new(&aead::AES_256_GCM, key).expect("AES-256 takes a 32-byte key");
        Self(std::sync::Arc::new(aead::LessSafeKey::new(unbound)))
    }

    fn nonce(seq: u64) -> aead::Nonce {
        let mut n = [0u8; aead::NONCE_LEN];
        n[..8].copy_from_slice(&seq.to_le_bytes());
        aead::Nonce::assume_unique_for_key(n)
    }

    /// Encrypts `body` in place as frame `seq` and returns its tag.
    pub fn seal(&self, seq: u64, header: &[u8; HEADER_LEN], body: &mut [u8]) -> [u8; TAG_LEN] {
        let tag = self
            .0
            .seal_in_place_separate_tag(Self::nonce(seq), aead::Aad::from(header), body)
            // AES-GCM refuses only inputs over 64 GiB; a frame body is at
            // most `MAX_BODY`.
            .expect("a frame body is far below AES-GCM's limit");
        let mut out = [0; TAG_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Decrypts `body` in place if `tag` is frame `seq`'s (ring compares
    /// it in constant time).
    pub fn open(
        &self,
        seq: u64,
        header: &[u8; HEADER_LEN],
        body: &mut [u8],
        tag: &[u8; TAG_LEN],
    ) -> bool {
        self.0
            .open_in_place_separate_tag(
                Self::nonce(seq),
                aead::Aad::from(header),
                aead::Tag::from(*tag),
                body,
                0..,
            )
            .is_ok()
    }
}

fn not_regular(path: &Path, meta: &std::fs::Metadata) -> Result<(), SecretError> {
    let t = meta.file_type();
    if t.is_file() {
        return Ok(());
    }
    let kind = if t.is_fifo() {
        "a FIFO"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a file"
    };
    Err(SecretError::NotRegular {
        path: path.to_owned(),
        kind,
    })
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
            max_version: 2,
            server_nonce: nonce(),
            max_inflight: 64,
            max_inline: 1 << 20,
        };
        let h = Hello {
            version: 2,
            caps: CAP_TCP_DATA,
            blob_bytes: 0,
            epoch: 4,
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
            epoch: 4,
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

        // Version 2 covers the epoch and what the CHALLENGE offered.
        let mut older = h.clone();
        older.epoch = 3;
        assert!(!s.verify_hello(&ch, &older));
        let mut downgraded = ch.clone();
        downgraded.max_inline = 4096;
        assert!(!s.verify_hello(&downgraded, &h));
    }

    #[test]
    fn frame_tags_bind_key_direction_sequence_header_and_body() {
        let (ch, mut h, _) = transcript();
        let s = secret("correct horse battery staple");
        let header = [7u8; HEADER_LEN];
        let plain = b"body continued".to_vec();
        assert_eq!(
            body_digest(&[b"body", b" continued"]),
            body_digest(&[&plain])
        );
        for version in [VERSION_2, VERSION_3] {
            h.version = u16::from(version);
            let keys = s.session_keys(&ch, &h);
            assert_eq!(keys.client_to_server.seals(), version == VERSION_3);
            let mut sent = plain.clone();
            let tag = keys.client_to_server.protect(3, &header, &mut sent);
            // Version 3 hides the body; version 2 leaves it as it is.
            assert_eq!(sent == plain, version == VERSION_2, "version {version}");
            let opens = |key: &FrameKey, seq: u64, header: &[u8; HEADER_LEN], body: &[u8]| {
                let mut b = body.to_vec();
                key.open(seq, header, &mut b, &tag).then_some(b)
            };
            assert_eq!(
                opens(&keys.client_to_server, 3, &header, &sent),
                Some(plain.clone())
            );
            // Replayed at another place, reflected back, altered, or from
            // another session (a fresh nonce): refused.
            assert_eq!(opens(&keys.client_to_server, 4, &header, &sent), None);
            assert_eq!(opens(&keys.server_to_client, 3, &header, &sent), None);
            let mut other_header = header;
            other_header[5] ^= 1;
            assert_eq!(opens(&keys.client_to_server, 3, &other_header, &sent), None);
            let mut other_body = sent.clone();
            other_body[13] ^= 1;
            assert_eq!(opens(&keys.client_to_server, 3, &header, &other_body), None);
            let mut other_session = h.clone();
            other_session.client_nonce = nonce();
            let other = s.session_keys(&ch, &other_session);
            assert_eq!(opens(&other.client_to_server, 3, &header, &sent), None);
        }
    }

    #[test]
    fn sealed_frames_use_a_fresh_nonce_per_frame() {
        let (ch, mut h, _) = transcript();
        h.version = u16::from(VERSION_3);
        let keys = secret("correct horse battery staple").session_keys(&ch, &h);
        let header = [7u8; HEADER_LEN];
        let (mut a, mut b) = (vec![0u8; 64], vec![0u8; 64]);
        let ta = keys.client_to_server.protect(0, &header, &mut a);
        let tb = keys.client_to_server.protect(1, &header, &mut b);
        // The same body sent twice is two different ciphertexts: the
        // sequence number is the nonce.
        assert_ne!(a, b);
        assert_ne!(ta, tb);
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
