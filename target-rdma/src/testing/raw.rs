//! A hand-driven session for hostile-peer tests: it does the real
//! handshake, then sends whatever bytes a test composes, tagged as a
//! version-2 client would (or not at all, to inject), and reads the
//! server's frames checking their tags.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::auth::{self, FrameKey, Secret};
use crate::proto::{
    self, Challenge, Header, Hello, Status, Welcome, CAP_TCP_DATA, HEADER_LEN, MAC_LEN, TAG_LEN,
    VERSION_2,
};

/// An authenticated session on a raw socket.
pub struct RawSession {
    /// The socket (tests shut it down, or stop reading it).
    pub stream: TcpStream,
    /// The server's answer to the HELLO.
    pub welcome: Welcome,
    /// The version negotiated.
    pub version: u8,
    keys: Option<(FrameKey, FrameKey)>,
    sent: u64,
    received: u64,
}

/// A HELLO the server refused: its status and message.
#[derive(Debug)]
pub struct Refusal {
    /// The status of the error frame.
    pub status: Status,
    /// Its message.
    pub message: String,
}

impl RawSession {
    /// Opens a session of `version` on `volume` presenting `epoch`; panics
    /// unless the server accepts it.
    pub fn open(addr: SocketAddr, volume: &str, secret: &Secret, version: u8, epoch: u64) -> Self {
        Self::try_open(addr, volume, secret, version, epoch).expect("the server accepts the HELLO")
    }

    /// Like [`RawSession::open`], returning the server's refusal.
    pub fn try_open(
        addr: SocketAddr,
        volume: &str,
        secret: &Secret,
        version: u8,
        epoch: u64,
    ) -> Result<Self, Refusal> {
        Self::try_open_offering(addr, volume, secret, version, epoch, CAP_TCP_DATA)
    }

    /// Like [`RawSession::try_open`], offering capabilities `caps` in the
    /// HELLO (an older client's set, say).
    pub fn try_open_offering(
        addr: SocketAddr,
        volume: &str,
        secret: &Secret,
        version: u8,
        epoch: u64,
        caps: u32,
    ) -> Result<Self, Refusal> {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .expect("set a hang guard");
        let mut body = Vec::new();
        let h = proto::read_frame(&mut stream, &mut body)
            .expect("a CHALLENGE")
            .expect("a CHALLENGE, not EOF");
        let ch = Challenge::decode(&h, &body).expect("a valid CHALLENGE");
        let mut hello = Hello {
            version: u16::from(version),
            caps,
            blob_bytes: 0,
            epoch,
            client_nonce: auth::nonce(),
            mac: [0; MAC_LEN],
            volume: volume.into(),
        };
        hello.mac = secret.sign_hello(&ch, &hello);
        let mut f = Vec::new();
        hello.encode(&mut f);
        stream.write_all(&f).expect("send HELLO");
        let h = proto::read_frame(&mut stream, &mut body)
            .expect("an answer to HELLO")
            .expect("an answer to HELLO, not EOF");
        if h.status != Status::Ok {
            return Err(Refusal {
                status: h.status,
                message: proto::decode_error(&body),
            });
        }
        let welcome = Welcome::decode(&h, &body, u16::from(version)).expect("a valid WELCOME");
        assert!(secret.verify_welcome(&ch, &hello, &welcome));
        let keys = (version >= VERSION_2).then(|| {
            let k = secret.session_keys(&ch, &hello);
            (k.client_to_server, k.server_to_client)
        });
        Ok(Self {
            stream,
            welcome,
            version,
            keys,
            sent: 0,
            received: 0,
        })
    }

    /// Sends an encoded frame as the session's next: its version byte set,
    /// and from version 2 its tag appended (in version 3 its body sealed).
    pub fn send(&mut self, frame: &[u8]) -> io::Result<()> {
        let mut f = frame.to_vec();
        f[4] = self.version;
        if let Some((key, _)) = &self.keys {
            let (header, body) = f.split_at_mut(HEADER_LEN);
            let header: &[u8; HEADER_LEN] = (&*header).try_into().expect("a header");
            let tag = key.protect(self.sent, header, body);
            f.extend_from_slice(&tag);
        }
        self.sent += 1;
        self.stream.write_all(&f)
    }

    /// The key that protects this session's frames to the server (from
    /// version 2): to forge a frame that is right but for one detail.
    pub fn client_key(&self) -> Option<&FrameKey> {
        self.keys.as_ref().map(|(k, _)| k)
    }

    /// Sends bytes as they are: what an attacker on the path injects.
    pub fn inject(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// The server's next frame (header, body), its tag checked; `None` when
    /// the server closed the connection.
    pub fn recv(&mut self) -> Option<(Header, Vec<u8>)> {
        let mut body = Vec::new();
        let h = match proto::read_frame(&mut self.stream, &mut body) {
            Ok(Some(h)) => h,
            Ok(None) => return None,
            Err(e) => panic!("reading the server's frame: {e}"),
        };
        assert_eq!(h.version, self.version, "the session's version");
        if let Some((_, key)) = &self.keys {
            let mut tag = [0u8; TAG_LEN];
            io::Read::read_exact(&mut self.stream, &mut tag).expect("the frame's tag");
            assert!(
                key.open(self.received, &h.encode(), &mut body, &tag),
                "the server's frame {} fails its tag",
                self.received
            );
        }
        self.received += 1;
        Some((h, body))
    }
}
