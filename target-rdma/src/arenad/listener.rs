//! The control port, bound at start but listening only once arenad serves.
//!
//! Opening the store and registering a large arena with an RDMA device
//! take seconds. A socket that listened meanwhile would queue connections
//! nobody answers, and a client would see its handshake time out. Bound
//! without `listen(2)`, a client's connect is refused at once (which it
//! reports as the peer not being up), and a port some process listens on
//! (another arenad, another service) stops this start before that work.
//! `SO_REUSEADDR`, as every listener has it, lets a restart bind while the
//! previous run's connections linger in TIME_WAIT; it also lets another
//! process bind the same port before we listen, in which case the first
//! `listen` wins and the other one's fails with EADDRINUSE.

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::OwnedFd;

use rustix::net::{bind, listen, socket_with, sockopt, AddressFamily, SocketFlags, SocketType};

/// Backlog of the control port.
const BACKLOG: i32 = 1024;

/// The bound, not yet listening, control port.
pub struct Reserved {
    fd: OwnedFd,
    addr: SocketAddr,
}

impl Reserved {
    /// Binds `addr` (`IP:port`) with `SO_REUSEADDR`, as a listener would.
    pub fn bind(addr: SocketAddr) -> io::Result<Self> {
        let family = if addr.is_ipv4() {
            AddressFamily::INET
        } else {
            AddressFamily::INET6
        };
        let fd = socket_with(family, SocketType::STREAM, SocketFlags::CLOEXEC, None)?;
        sockopt::set_socket_reuseaddr(&fd, true)?;
        bind(&fd, &addr)?;
        let addr = SocketAddr::try_from(rustix::net::getsockname(&fd)?)
            .map_err(|_| io::Error::other("the control socket has no IP address"))?;
        Ok(Self { fd, addr })
    }

    /// The bound address (the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Starts accepting connections.
    pub fn listen(self) -> io::Result<TcpListener> {
        listen(&self.fd, BACKLOG)?;
        Ok(TcpListener::from(self.fd))
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpStream;

    use super::*;

    #[test]
    fn a_reserved_port_refuses_connections_until_it_listens() {
        let r = Reserved::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = r.local_addr();
        let e = TcpStream::connect(addr).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
        let l = r.listen().unwrap();
        assert!(
            Reserved::bind(addr).is_err(),
            "a listened port stops a start"
        );
        let c = TcpStream::connect(addr).unwrap();
        let (s, _) = l.accept().unwrap();
        assert_eq!(s.peer_addr().unwrap(), c.local_addr().unwrap());
    }
}
