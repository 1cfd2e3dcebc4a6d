//! The kernel's view of one arena connection (`TCP_INFO`): retransmitted
//! segments, smoothed RTT and congestion window, sampled by the
//! connection's reader thread when it opens, every [`SAMPLE_EVERY`]
//! answers and when it closes, into the process's [`TcpLinks`].

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use ublk_metrics::{TcpInfoSample, TcpLink, TcpLinks};

/// Answers between two samples: one `getsockopt` per 256 answers is
/// nothing next to the answers' own system calls.
pub(super) const SAMPLE_EVERY: u32 = 256;

/// Reads `TCP_INFO` of `stream`.
pub fn read(stream: &TcpStream) -> io::Result<TcpInfoSample> {
    // SAFETY: `tcp_info` is a C struct of integers, for which all-zero
    // bytes are a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the descriptor belongs to `stream`, borrowed for the call, so
    // it stays open; `info` is a writable `tcp_info` of `len` bytes, and
    // the kernel writes at most `len` bytes and stores the length it wrote.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // Older kernels fill a shorter struct: the fields used here must be in it.
    let needed = std::mem::offset_of!(libc::tcp_info, tcpi_total_retrans) + 4;
    if (len as usize) < needed {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("TCP_INFO is {len} bytes, tcpi_total_retrans needs {needed}"),
        ));
    }
    Ok(TcpInfoSample {
        total_retrans: info.tcpi_total_retrans,
        rtt_us: info.tcpi_rtt,
        cwnd: info.tcpi_snd_cwnd,
    })
}

/// One connection's link into [`TcpLinks`], and when to sample next.
pub(super) struct Sampler {
    link: TcpLink,
    answers: u32,
}

impl Sampler {
    /// Opens the connection's link and takes the first sample (the
    /// handshake already measured an RTT).
    pub(super) fn open(links: &Arc<TcpLinks>, stream: &TcpStream) -> Sampler {
        let mut s = Sampler {
            link: links.open(),
            answers: 0,
        };
        s.sample(stream);
        s
    }

    /// One more answer; every [`SAMPLE_EVERY`] answers, a sample.
    #[inline]
    pub(super) fn answered(&mut self, stream: &TcpStream) {
        self.answers += 1;
        if self.answers >= SAMPLE_EVERY {
            self.answers = 0;
            self.sample(stream);
        }
    }

    /// The last sample, before the connection's socket is closed; the link
    /// leaves the gauges, its retransmissions stay counted.
    pub(super) fn close(mut self, stream: &TcpStream) {
        self.sample(stream);
    }

    fn sample(&mut self, stream: &TcpStream) {
        // A socket that cannot say (closed under us) gives no sample; the
        // previous one stands.
        if let Ok(s) = read(stream) {
            self.link.sample(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// A real loopback connection after some traffic: an RTT and a window,
    /// and (on loopback) no retransmissions.
    #[test]
    fn a_loopback_connection_reports_rtt_and_window() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let echo = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 4096];
            for _ in 0..64 {
                s.read_exact(&mut buf).unwrap();
                s.write_all(&buf).unwrap();
            }
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let mut buf = [7u8; 4096];
        for _ in 0..64 {
            c.write_all(&buf).unwrap();
            c.read_exact(&mut buf).unwrap();
        }
        echo.join().unwrap();
        let s = read(&c).unwrap();
        assert!(s.rtt_us > 0, "{s:?}");
        assert!(s.cwnd > 0, "{s:?}");
        assert_eq!(s.total_retrans, 0, "{s:?}");

        let links = Arc::new(TcpLinks::default());
        let sampler = Sampler::open(&links, &c);
        let open = links.summary();
        assert_eq!(open.connections, 1);
        assert!(open.rtt_max > 0.0 && open.cwnd_min > 0.0, "{open:?}");
        sampler.close(&c);
        assert_eq!(links.summary().connections, 0);
    }
}
