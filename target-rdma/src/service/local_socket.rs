//! A daemon's local admin socket, the same for `ublkd`'s control socket and
//! `arenad`'s admin socket: a Unix stream socket, root-only (0600) unless a
//! group is configured (0660, that group), one JSON object per line each
//! way. Operators are few and local; connections are bounded all the same,
//! and a line longer than the limit is answered, not read on.

use std::ffi::CString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rustix::fs::Mode;
use rustix::process::umask;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Why the socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Another daemon answers on the path.
    #[error("another {daemon} is already listening on {path}")]
    InUse {
        /// The daemon binding.
        daemon: &'static str,
        /// The socket path.
        path: String,
    },
    /// The group does not exist.
    #[error("socket_group {0:?} does not exist")]
    NoSuchGroup(String),
    /// A component of the socket's directory is not a directory.
    #[error("control socket {path}: {ancestor} is not a directory")]
    NotADirectory {
        /// The socket path.
        path: String,
        /// The first ancestor that exists and is something else.
        ancestor: String,
    },
    /// Filesystem trouble.
    #[error("control socket {path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

fn gid_of(group: &str) -> Option<u32> {
    let name = CString::new(group).ok()?;
    // SAFETY: getgrnam reads a NUL-terminated string we own; the result is
    // only dereferenced when non-null, before any other getgr* call.
    let gr = unsafe { libc::getgrnam(name.as_ptr()) };
    if gr.is_null() {
        None
    } else {
        // SAFETY: non-null pointer to libc's static group record.
        Some(unsafe { (*gr).gr_gid })
    }
}

/// Whether `group` names a group of this host (`socket_group`).
pub fn group_exists(group: &str) -> bool {
    gid_of(group).is_some()
}

/// Binds the socket of `daemon` at `path` with the configured ownership
/// and mode; a socket left by a crashed daemon is replaced, a live one is
/// [`SocketError::InUse`].
pub fn bind(
    daemon: &'static str,
    path: &Path,
    group: Option<&str>,
) -> Result<UnixListener, SocketError> {
    let io = |source| SocketError::Io {
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent() {
        // create_dir_all reports an ancestor that is a file as EEXIST,
        // which names no cause: find the ancestor and say what it is.
        if let Some(file) = dir.ancestors().find(|a| a.exists() && !a.is_dir()) {
            return Err(SocketError::NotADirectory {
                path: path.display().to_string(),
                ancestor: file.display().to_string(),
            });
        }
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(SocketError::InUse {
                daemon,
                path: path.display().to_string(),
            });
        }
        std::fs::remove_file(path).map_err(io)?;
    }
    let gid = match group {
        Some(g) => Some(gid_of(g).ok_or_else(|| SocketError::NoSuchGroup(g.to_owned()))?),
        None => None,
    };
    // Bind with a umask that leaves no window where others could connect.
    let old = umask(Mode::from_raw_mode(0o177));
    let bound = UnixListener::bind(path);
    umask(old);
    let listener = bound.map_err(io)?;
    if let Some(gid) = gid {
        std::os::unix::fs::chown(path, None, Some(gid)).map_err(io)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(io)?;
    } else {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    }
    Ok(listener)
}

/// One request line as read, for the daemon's handler.
pub enum Line<'a> {
    /// A whole line, without its newline.
    Request(&'a str),
    /// A line longer than the limit: it was not read on.
    TooLong,
}

/// How a socket is served.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Longest request line read.
    pub max_line: usize,
    /// Most connections served at once; more are closed at accept.
    pub max_connections: usize,
}

fn serve_conn(stream: UnixStream, max_line: usize, handle: &dyn Fn(Line<'_>) -> String) {
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream.take(u64::MAX));
    loop {
        let mut line = String::new();
        reader.get_mut().set_limit(max_line as u64);
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let too_long = !line.ends_with('\n') && line.len() >= max_line;
        let mut out = handle(if too_long {
            Line::TooLong
        } else {
            Line::Request(line.trim_end())
        });
        out.push('\n');
        if writer.write_all(out.as_bytes()).is_err() || too_long {
            return;
        }
    }
}

/// Accepts connections until the listener fails, one thread each (a
/// handful of operators, never a hot path); `handle` answers each line
/// with one line. `on_error` is told of an accept or spawn that failed.
pub fn serve(
    listener: UnixListener,
    thread_name: &str,
    limits: Limits,
    handle: Arc<dyn Fn(Line<'_>) -> String + Send + Sync>,
    on_error: impl Fn(&str, &std::io::Error),
) {
    let open = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let stream = match conn {
            Ok(stream) => stream,
            Err(e) => {
                on_error("accept", &e);
                continue;
            }
        };
        if open.fetch_add(1, Ordering::AcqRel) >= limits.max_connections {
            open.fetch_sub(1, Ordering::AcqRel);
            continue;
        }
        let (h, o) = (Arc::clone(&handle), Arc::clone(&open));
        let spawned = std::thread::Builder::new()
            .name(thread_name.into())
            .spawn(move || {
                serve_conn(stream, limits.max_line, &*h);
                o.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            open.fetch_sub(1, Ordering::AcqRel);
            on_error("spawn", &e);
        }
    }
}

/// One line of a daemon's protocol: the sender's protocol version, with
/// the body's fields beside it (`{"version":1,"op":"list"}`), so a daemon
/// and a tool of different versions fail clearly instead of guessing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Versioned<T> {
    /// The sender's protocol version.
    pub version: u32,
    /// The request or the answer.
    #[serde(flatten)]
    pub body: T,
}

/// The answer to one request: `{"status":"ok","reply":...}` or
/// `{"status":"error","kind":...,"message":...}`, the reply and the closed
/// set of error kinds being each protocol's own.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Answer<R, K> {
    /// The request succeeded.
    Ok {
        /// What it produced.
        reply: R,
    },
    /// The request failed; nothing changed.
    Error {
        /// Why, for scripts.
        kind: K,
        /// Why, for people.
        message: String,
    },
}

/// Why a request line was not read as a request.
#[derive(Debug, PartialEq, Eq)]
enum LineError {
    /// Not a JSON object.
    NotJson(String),
    /// No `version` field.
    NoVersion,
    /// A version this daemon does not speak.
    Unsupported(u32),
    /// Of this version, but not a request.
    Invalid(String),
}

/// Reads `line` as a request of protocol `version`. The version is looked
/// at first, so a newer tool hears that its version is not spoken rather
/// than which field was not understood.
fn parse_versioned<T: DeserializeOwned>(line: &str, version: u32) -> Result<T, LineError> {
    #[derive(Deserialize)]
    struct VersionOnly {
        version: Option<u32>,
    }
    let v: VersionOnly =
        serde_json::from_str(line).map_err(|e| LineError::NotJson(e.to_string()))?;
    match v.version {
        None => return Err(LineError::NoVersion),
        Some(v) if v != version => return Err(LineError::Unsupported(v)),
        Some(_) => {}
    }
    serde_json::from_str::<Versioned<T>>(line)
        .map(|r| r.body)
        .map_err(|e| LineError::Invalid(e.to_string()))
}

/// Reads `line` as a request of `daemon`'s protocol `version`; a line
/// that is not one is answered: error kind `unsupported` for another
/// version, `bad` for anything else, with a message naming the problem.
pub fn parse_request<Q: DeserializeOwned, R, K>(
    daemon: &str,
    line: &str,
    version: u32,
    bad: K,
    unsupported: K,
) -> Result<Q, Box<Answer<R, K>>> {
    parse_versioned(line, version).map_err(|e| {
        let (kind, message) = match e {
            LineError::NotJson(e) => (bad, format!("not a JSON object: {e}")),
            LineError::NoVersion => (bad, "missing \"version\"".into()),
            LineError::Unsupported(v) => (
                unsupported,
                format!(
                    "protocol version {v} is not supported; this {daemon} speaks version {version}"
                ),
            ),
            LineError::Invalid(e) => (bad, format!("invalid request: {e}")),
        };
        Box::new(Answer::Error { kind, message })
    })
}

/// The answer line of protocol `version` for `body`.
pub fn answer_line<T: Serialize>(version: u32, body: T) -> String {
    // Answers are plain data: serializing one fails only by a bug, and
    // even then the tool gets a line that says so.
    serde_json::to_string(&Versioned { version, body }).unwrap_or_else(|e| {
        serde_json::json!({ "version": version, "error": e.to_string() }).to_string()
    })
}

/// Sends `request` of protocol `version` to `daemon` on `socket` and waits
/// up to `timeout` for its answer.
pub fn call_versioned<Q: Serialize, A: DeserializeOwned>(
    daemon: &'static str,
    socket: &Path,
    version: u32,
    request: Q,
    max_line: usize,
    timeout: Duration,
) -> Result<A, ClientError> {
    let bad = |detail: String| ClientError::BadAnswer { daemon, detail };
    let line = serde_json::to_string(&Versioned {
        version,
        body: request,
    })
    .map_err(|e| bad(e.to_string()))?;
    let answer = call(daemon, socket, &line, max_line, timeout)?;
    serde_json::from_str::<Versioned<A>>(&answer)
        .map(|a| a.body)
        .map_err(|e| bad(e.to_string()))
}

/// The socket path the daemon's config file at `config` sets under `key`,
/// for its client tool: `None` when the file does not exist, does not
/// parse or does not set it. Only that key is read, so a file with
/// mistakes elsewhere still leads the tool to the daemon, whose reload
/// then names what is wrong with it.
pub fn configured_socket(config: &Path, key: &str) -> std::io::Result<Option<String>> {
    if !config.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(config)?;
    Ok(text
        .parse::<toml::Table>()
        .ok()
        .and_then(|t| t.get(key)?.as_str().map(str::to_owned)))
}

/// Why a client's call failed before any answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No socket file.
    #[error("{daemon} is not running: its socket {path} does not exist (start it with `systemctl start {daemon}`)")]
    NotRunning {
        /// The daemon called.
        daemon: &'static str,
        /// Socket path.
        path: PathBuf,
    },
    /// The file exists but nobody listens.
    #[error("{daemon} is not running: nothing listens on {path} (stale socket; start it with `systemctl start {daemon}`)")]
    Refused {
        /// The daemon called.
        daemon: &'static str,
        /// Socket path.
        path: PathBuf,
    },
    /// Socket permissions.
    #[error("permission denied on {0}: run as root or as a member of the daemon's socket_group")]
    PermissionDenied(PathBuf),
    /// Any other I/O failure.
    #[error("talking to {daemon} on {path}: {source}")]
    Io {
        /// The daemon called.
        daemon: &'static str,
        /// Socket path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The daemon's answer was not understood.
    #[error("{daemon} sent an answer this tool does not understand: {detail}")]
    BadAnswer {
        /// The daemon called.
        daemon: &'static str,
        /// Why.
        detail: String,
    },
}

/// Sends `line` (one JSON object, no newline) to `daemon` on `socket` and
/// waits up to `timeout` for its one-line answer.
fn call(
    daemon: &'static str,
    socket: &Path,
    line: &str,
    max_line: usize,
    timeout: Duration,
) -> Result<String, ClientError> {
    let path = socket.to_owned();
    let io = |source: std::io::Error| ClientError::Io {
        daemon,
        path: path.clone(),
        source,
    };
    let mut stream = UnixStream::connect(socket).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => ClientError::NotRunning {
            daemon,
            path: socket.to_owned(),
        },
        std::io::ErrorKind::ConnectionRefused => ClientError::Refused {
            daemon,
            path: socket.to_owned(),
        },
        std::io::ErrorKind::PermissionDenied => ClientError::PermissionDenied(socket.to_owned()),
        _ => io(e),
    })?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream
        .write_all(format!("{line}\n").as_bytes())
        .map_err(io)?;
    let mut answer = String::new();
    BufReader::new(stream.take(max_line as u64))
        .read_line(&mut answer)
        .map_err(io)?;
    if answer.is_empty() {
        return Err(ClientError::BadAnswer {
            daemon,
            detail: "connection closed without an answer".into(),
        });
    }
    Ok(answer)
}
