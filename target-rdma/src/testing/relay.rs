//! A TCP relay that records every byte it carries, per connection and
//! direction: what anyone on the path between a client and its peer sees.
//! The confidentiality tests look for payloads in it.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;

use crate::proto::{Header, Hello, HEADER_LEN};

/// The bytes of one relayed connection, per direction.
#[derive(Default)]
pub struct Seen {
    /// From the client to the peer.
    pub to_peer: Vec<u8>,
    /// From the peer to the client.
    pub to_client: Vec<u8>,
}

impl Seen {
    /// The version the client chose in its HELLO (the connection's first
    /// frame): the session's protocol version.
    pub fn version(&self) -> u16 {
        let head: &[u8; HEADER_LEN] = self.to_peer[..HEADER_LEN]
            .try_into()
            .expect("a HELLO header crossed");
        let h = Header::decode(head).expect("a HELLO header");
        let body = &self.to_peer[HEADER_LEN..HEADER_LEN + h.body_len as usize];
        Hello::version_of(&h, body).expect("a HELLO body")
    }
}

/// A relay to one peer, recording every connection it carries.
pub struct Relay {
    /// Where clients connect instead of the peer.
    pub addr: SocketAddr,
    conns: Arc<Mutex<Vec<Arc<Mutex<Seen>>>>>,
}

impl Relay {
    /// Relays every connection made to [`Relay::addr`] to `peer`.
    pub fn start(peer: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        let addr = listener.local_addr().expect("the relay's address");
        let conns: Arc<Mutex<Vec<Arc<Mutex<Seen>>>>> = Arc::default();
        let all = Arc::clone(&conns);
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(peer) else {
                    continue;
                };
                let seen = Arc::new(Mutex::new(Seen::default()));
                all.lock().expect("relay lock").push(Arc::clone(&seen));
                pipe(&client, &server, true, &seen);
                pipe(&server, &client, false, &seen);
            }
        });
        Self { addr, conns }
    }

    /// Every connection so far, with what crossed it until now.
    pub fn seen(&self) -> Vec<Arc<Mutex<Seen>>> {
        self.conns.lock().expect("relay lock").clone()
    }
}

/// Copies `from` to `to`, recording first, so what an answer carried is
/// recorded before the client has it.
fn pipe(from: &TcpStream, to: &TcpStream, up: bool, seen: &Arc<Mutex<Seen>>) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
        return;
    };
    let seen = Arc::clone(seen);
    thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            {
                let mut s = seen.lock().expect("relay lock");
                let dir = if up { &mut s.to_peer } else { &mut s.to_client };
                dir.extend_from_slice(&buf[..n]);
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}

/// Whether any aligned 32-byte run of `needle` occurs in `hay`: a payload
/// that crossed readable, even split across frames.
pub fn leaks(hay: &[u8], needle: &[u8]) -> bool {
    let runs: HashSet<&[u8]> = needle.chunks_exact(32).collect();
    hay.windows(32).any(|w| runs.contains(w))
}
