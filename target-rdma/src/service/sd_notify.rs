//! systemd readiness notification (`Type=notify`), without libsystemd.

use std::os::unix::net::UnixDatagram;

/// Sends `state` (e.g. `READY=1`) to `$NOTIFY_SOCKET` if systemd set one.
/// Returns whether a message was sent; outside systemd this does nothing.
pub fn notify(state: &str) -> std::io::Result<bool> {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(false);
    };
    let sock = UnixDatagram::unbound()?;
    let bytes = path.as_encoded_bytes();
    if let Some(abstract_name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(abstract_name)?;
        sock.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        sock.send_to(state.as_bytes(), &path)?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sends_to_the_socket_systemd_names() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let rx = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        std::env::set_var("NOTIFY_SOCKET", &path);
        assert!(super::notify("READY=1").unwrap());
        std::env::remove_var("NOTIFY_SOCKET");
        let mut buf = [0u8; 32];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
        assert!(!super::notify("READY=1").unwrap());
    }
}
