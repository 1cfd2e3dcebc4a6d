//! The listener's one event-loop thread: accepts, reads request heads,
//! writes answers, and enforces the deadlines and the connection bound,
//! for every connection at once on epoll with non-blocking sockets.
//!
//! Deadlines are constant offsets from an event (accept, a complete head),
//! so each kind is kept in a queue in deadline order and expiring them is
//! popping the front. Entries of connections that moved on stay queued
//! until they reach the front (or a compaction past a multiple of
//! `max_connections` drops them), so the queues stay bounded too.

use super::render::{Done, Job, Renderers};
use super::routes::{self, Route};
use super::{HttpConfig, HttpRejection};
use crate::events;
use crate::telemetry::Telemetry;
use rustix::buffer::spare_capacity;
use rustix::event::epoll::{self, CreateFlags, EventData, EventFlags};
use rustix::event::{eventfd, EventfdFlags, Timespec};
use rustix::fd::OwnedFd;
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const LISTENER: u64 = u64::MAX;
const WAKE: u64 = u64::MAX - 1;
/// How long accepting pauses after `accept` failed (EMFILE and the like
/// leave the listener readable: retrying at once would spin).
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);
/// Least interval between two `metrics.accept_failed` log lines.
const ACCEPT_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// Events taken per wait.
const EVENTS: usize = 256;
/// Bytes read per `read` call while a head arrives.
const CHUNK: usize = 1024;

/// Stops the loop: sets the flag, then wakes it.
pub(super) struct Stop {
    flag: Arc<AtomicBool>,
    wake: Arc<OwnedFd>,
}

impl Stop {
    pub(super) fn stop(&self) {
        self.flag.store(true, Ordering::Release);
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
    }
}

/// Starts the event loop and the render workers on `listener`.
pub(super) fn spawn(
    listener: TcpListener,
    tel: Arc<Telemetry>,
    config: HttpConfig,
) -> std::io::Result<(Stop, Vec<JoinHandle<()>>)> {
    listener.set_nonblocking(true)?;
    let epoll = epoll::create(CreateFlags::CLOEXEC)?;
    let wake = Arc::new(eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?);
    epoll::add(
        &epoll,
        &listener,
        EventData::new_u64(LISTENER),
        EventFlags::IN,
    )?;
    epoll::add(&epoll, &*wake, EventData::new_u64(WAKE), EventFlags::IN)?;
    let (done_tx, done) = mpsc::channel();
    let renderers = Renderers::spawn(&tel, &done_tx, &wake)?;
    let flag = Arc::new(AtomicBool::new(false));
    let mut lp = Loop {
        epoll,
        listener,
        wake: Arc::clone(&wake),
        stop: Arc::clone(&flag),
        tel,
        config,
        renderers,
        done,
        conns: Vec::new(),
        free: Vec::new(),
        open: 0,
        generation: 0,
        heads: VecDeque::new(),
        answers: VecDeque::new(),
        accept_paused_until: None,
        accept_logged: None,
    };
    let handle = std::thread::Builder::new()
        .name("metrics-http".into())
        .spawn(move || lp.run())?;
    Ok((Stop { flag, wake }, vec![handle]))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Reading the request head (the only phase that can be shed).
    Head,
    /// A render worker builds the answer.
    Rendering,
    /// Writing the answer.
    Answer,
}

struct Conn {
    stream: TcpStream,
    token: u64,
    phase: Phase,
    head: Vec<u8>,
    out: Vec<u8>,
    sent: usize,
}

struct Loop {
    epoll: OwnedFd,
    listener: TcpListener,
    wake: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
    tel: Arc<Telemetry>,
    config: HttpConfig,
    renderers: Renderers,
    done: Receiver<Done>,
    /// Connections by slot; a token is `generation << 32 | slot`, so an
    /// event or an answer for a closed connection finds no match.
    conns: Vec<Option<Conn>>,
    free: Vec<u32>,
    open: usize,
    generation: u32,
    /// Request-head deadlines, in accept order (= deadline order).
    heads: VecDeque<(Instant, u64)>,
    /// Answer deadlines, in order of complete heads (= deadline order).
    answers: VecDeque<(Instant, u64)>,
    accept_paused_until: Option<Instant>,
    accept_logged: Option<Instant>,
}

fn phase_of(conns: &[Option<Conn>], token: u64) -> Option<Phase> {
    match conns.get(token as u32 as usize) {
        Some(Some(c)) if c.token == token => Some(c.phase),
        _ => None,
    }
}

impl Loop {
    fn run(&mut self) {
        let mut events = Vec::with_capacity(EVENTS);
        while !self.stop.load(Ordering::Acquire) {
            let timeout = self.next_timeout(Instant::now());
            events.clear();
            if let Err(e) = epoll::wait(&self.epoll, spare_capacity(&mut events), timeout.as_ref())
            {
                if e != rustix::io::Errno::INTR {
                    // Not expected from a valid epoll fd; do not spin.
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            for ev in events.drain(..) {
                let (token, flags) = (ev.data.u64(), ev.flags);
                match token {
                    LISTENER => self.accept(),
                    WAKE => self.woken(),
                    t => self.ready(t, flags),
                }
            }
            self.expire(Instant::now());
        }
    }

    fn next_timeout(&self, now: Instant) -> Option<Timespec> {
        let next = [
            self.heads.front().map(|e| e.0),
            self.answers.front().map(|e| e.0),
            self.accept_paused_until,
        ]
        .into_iter()
        .flatten()
        .min()?;
        // Rounded up so the wait does not end just before the deadline.
        let wait = next.saturating_duration_since(now) + Duration::from_millis(1);
        Timespec::try_from(wait).ok()
    }

    fn conn(&mut self, token: u64) -> Option<&mut Conn> {
        match self.conns.get_mut(token as u32 as usize) {
            Some(Some(c)) if c.token == token => Some(c),
            _ => None,
        }
    }

    fn accept(&mut self) {
        if self.accept_paused_until.is_some() {
            return;
        }
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => self.admit(stream),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted | ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => {
                    self.tel.http_rejected(HttpRejection::AcceptError);
                    let now = Instant::now();
                    if self
                        .accept_logged
                        .is_none_or(|t| now.duration_since(t) >= ACCEPT_LOG_INTERVAL)
                    {
                        self.accept_logged = Some(now);
                        tracing::warn!(event = events::METRICS_ACCEPT_FAILED, error = %e, "pausing accept");
                    }
                    let _ = epoll::modify(
                        &self.epoll,
                        &self.listener,
                        EventData::new_u64(LISTENER),
                        EventFlags::empty(),
                    );
                    self.accept_paused_until = Some(now + ACCEPT_PAUSE);
                    return;
                }
            }
        }
    }

    fn admit(&mut self, stream: TcpStream) {
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        if self.open >= self.config.max_connections && !self.shed_oldest() {
            self.tel.http_rejected(HttpRejection::Refused);
            return;
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.conns.push(None);
                (self.conns.len() - 1) as u32
            }
        };
        self.generation = self.generation.wrapping_add(1);
        let token = u64::from(self.generation) << 32 | u64::from(slot);
        let watched = epoll::add(
            &self.epoll,
            &stream,
            EventData::new_u64(token),
            EventFlags::IN | EventFlags::RDHUP,
        );
        if watched.is_err() {
            self.free.push(slot);
            return;
        }
        self.conns[slot as usize] = Some(Conn {
            stream,
            token,
            phase: Phase::Head,
            head: Vec::new(),
            out: Vec::new(),
            sent: 0,
        });
        self.open += 1;
        self.heads
            .push_back((Instant::now() + self.config.request_timeout, token));
        if self.heads.len() > 4 * self.config.max_connections.max(64) {
            let conns = &self.conns;
            self.heads
                .retain(|&(_, t)| phase_of(conns, t) == Some(Phase::Head));
        }
    }

    /// Closes the oldest connection still reading its head; false when
    /// there is none.
    fn shed_oldest(&mut self) -> bool {
        while let Some((_, token)) = self.heads.pop_front() {
            if phase_of(&self.conns, token) == Some(Phase::Head) {
                self.close(token, Some(HttpRejection::Shed));
                return true;
            }
        }
        false
    }

    fn woken(&mut self) {
        let mut count = [0u8; 8];
        let _ = rustix::io::read(&*self.wake, &mut count);
        while let Ok(d) = self.done.try_recv() {
            if phase_of(&self.conns, d.token) == Some(Phase::Rendering) {
                self.answer(d.token, d.answer);
            }
        }
    }

    fn ready(&mut self, token: u64, flags: EventFlags) {
        match phase_of(&self.conns, token) {
            Some(Phase::Head) => self.read_head(token),
            // The client went away while its answer is being built.
            Some(Phase::Rendering) if flags.intersects(EventFlags::HUP | EventFlags::ERR) => {
                self.close(token, None)
            }
            Some(Phase::Rendering) | None => {}
            Some(Phase::Answer) => self.flush(token),
        }
    }

    fn read_head(&mut self, token: u64) {
        let max = self.config.max_request_bytes;
        let Some(c) = self.conn(token) else { return };
        let mut chunk = [0u8; CHUNK];
        let complete = loop {
            match c.stream.read(&mut chunk) {
                Ok(0) => break None,
                Ok(n) => {
                    let from = c.head.len().saturating_sub(3);
                    c.head.extend_from_slice(&chunk[..n]);
                    if c.head.len() > max {
                        break Some(false);
                    }
                    if c.head[from..].windows(4).any(|w| w == b"\r\n\r\n") {
                        break Some(true);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break None,
            }
        };
        match complete {
            // Closed (or failed) before a complete head.
            None => self.close(token, None),
            Some(false) => {
                self.tel.http_rejected(HttpRejection::Oversized);
                self.start_answer(token, routes::plain(400, "request head too large\n"));
            }
            Some(true) => self.request(token),
        }
    }

    fn request(&mut self, token: u64) {
        let openmetrics = self.tel.openmetrics_enabled();
        let Some(c) = self.conn(token) else { return };
        let head = std::mem::take(&mut c.head);
        match routes::route(&head, openmetrics) {
            Route::Now(answer) => self.start_answer(token, answer),
            Route::Render { what, head_only } => {
                let job = Job {
                    token,
                    what,
                    head_only,
                };
                if self.renderers.submit(job).is_err() {
                    self.tel.http_rejected(HttpRejection::Busy);
                    self.start_answer(token, routes::plain(503, "busy\n"));
                    return;
                }
                self.set_phase(token, Phase::Rendering, EventFlags::empty());
                self.push_answer_deadline(token);
            }
        }
    }

    /// Answers `token` now (its head is complete, or refused).
    fn start_answer(&mut self, token: u64, answer: Vec<u8>) {
        self.push_answer_deadline(token);
        self.answer(token, answer);
    }

    fn push_answer_deadline(&mut self, token: u64) {
        self.answers
            .push_back((Instant::now() + self.config.write_timeout, token));
        if self.answers.len() > 4 * self.config.max_connections.max(64) {
            let conns = &self.conns;
            self.answers.retain(|&(_, t)| {
                matches!(phase_of(conns, t), Some(Phase::Rendering | Phase::Answer))
            });
        }
    }

    fn answer(&mut self, token: u64, answer: Vec<u8>) {
        let Some(c) = self.conn(token) else { return };
        c.out = answer;
        c.sent = 0;
        self.set_phase(token, Phase::Answer, EventFlags::OUT);
        self.flush(token);
    }

    fn set_phase(&mut self, token: u64, phase: Phase, interest: EventFlags) {
        let Some(c) = self
            .conns
            .get_mut(token as u32 as usize)
            .and_then(Option::as_mut)
        else {
            return;
        };
        c.phase = phase;
        let watched = epoll::modify(&self.epoll, &c.stream, EventData::new_u64(token), interest);
        if watched.is_err() {
            self.close(token, None);
        }
    }

    fn flush(&mut self, token: u64) {
        let Some(c) = self.conn(token) else { return };
        while c.sent < c.out.len() {
            match c.stream.write(&c.out[c.sent..]) {
                Ok(0) => break,
                Ok(n) => c.sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let _ = c.stream.shutdown(Shutdown::Write);
        self.close(token, None);
    }

    fn close(&mut self, token: u64, why: Option<HttpRejection>) {
        let slot = token as u32;
        let Some(entry) = self.conns.get_mut(slot as usize) else {
            return;
        };
        if entry.as_ref().is_none_or(|c| c.token != token) {
            return;
        }
        // Dropping the stream closes it, which also leaves the epoll set.
        *entry = None;
        self.free.push(slot);
        self.open -= 1;
        if let Some(why) = why {
            self.tel.http_rejected(why);
        }
    }

    fn expire(&mut self, now: Instant) {
        if self.accept_paused_until.is_some_and(|t| t <= now) {
            self.accept_paused_until = None;
            let _ = epoll::modify(
                &self.epoll,
                &self.listener,
                EventData::new_u64(LISTENER),
                EventFlags::IN,
            );
        }
        while let Some(&(at, token)) = self.heads.front() {
            if at > now {
                break;
            }
            self.heads.pop_front();
            if phase_of(&self.conns, token) == Some(Phase::Head) {
                if let Some(c) = self.conn(token) {
                    // One non-blocking try: a trickler gets no more.
                    let _ = c.stream.write(&routes::plain(408, "request timeout\n"));
                }
                self.close(token, Some(HttpRejection::RequestDeadline));
            }
        }
        while let Some(&(at, token)) = self.answers.front() {
            if at > now {
                break;
            }
            self.answers.pop_front();
            if matches!(
                phase_of(&self.conns, token),
                Some(Phase::Rendering | Phase::Answer)
            ) {
                self.close(token, Some(HttpRejection::WriteDeadline));
            }
        }
    }
}
