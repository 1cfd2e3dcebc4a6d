//! The socket a connection's receiver reads: through its read timeout on a
//! reader thread, or never blocking when the owner's ring drives it, then
//! with one `recv` per readiness.

use std::io;
use std::net::TcpStream;

/// What the receiver reads from: the socket, through its read timeout
/// (reader thread) or never blocking (driven).
pub(super) struct Source {
    pub(super) stream: TcpStream,
    pub(super) nonblocking: bool,
    /// A non-blocking read got fewer bytes than it asked for: the socket
    /// was empty then, so the next read would only say `WouldBlock`. It
    /// says so without the syscall (one `recv` per readiness at QD 1, not
    /// two); the owner's poll, armed next, reports what arrives later.
    pub(super) drained: bool,
}

impl io::Read for Source {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.nonblocking {
            return io::Read::read(&mut self.stream, buf);
        }
        if self.drained {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let want = buf.len();
        let n = rustix::net::recv(&self.stream, buf, rustix::net::RecvFlags::DONTWAIT)
            .map(|(n, _)| n)
            .map_err(io::Error::from)?;
        self.drained = n > 0 && n < want;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    use super::Source;

    /// A short non-blocking read means the socket was empty: the next read
    /// of the same readiness says `WouldBlock` without asking the kernel,
    /// and bytes that arrived meanwhile are read once the owner reads
    /// again after its poll (nothing is lost, nothing is read twice).
    #[test]
    fn a_drained_source_waits_for_the_next_readiness_and_loses_nothing() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (stream, _) = l.accept().unwrap();
        let mut src = Source {
            stream,
            nonblocking: true,
            drained: false,
        };
        let mut buf = [0u8; 64];
        let empty = src.read(&mut buf).unwrap_err();
        assert_eq!(empty.kind(), std::io::ErrorKind::WouldBlock);
        assert!(!src.drained, "a read that got nothing proves nothing");

        tx.write_all(b"first").unwrap();
        let mut n = Err(empty);
        for _ in 0..1000 {
            n = src.read(&mut buf);
            if n.is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(&buf[..n.unwrap()], b"first");
        assert!(src.drained);

        tx.write_all(b"second").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let e = src.read(&mut buf).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);

        // The owner's poll said readable: pump reads again.
        src.drained = false;
        let n = src.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"second");
    }
}
