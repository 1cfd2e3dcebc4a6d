//! What a daemon process needs around its service, the same for `ublkd` and
//! `arenad`: its config file and a reload's changes ([`config_file`], with
//! [`size`] for byte sizes), the manual of that file ([`config_doc`]), the checks of a start without starting
//! ([`preflight`]), systemd readiness ([`sd_notify`]) and the one-line print
//! of the error that ends it ([`error_chain`]), and its local admin socket
//! ([`local_socket`]).

pub mod config_doc;
pub mod config_file;
pub mod error_chain;
pub mod local_socket;
pub mod preflight;
pub mod sd_notify;
pub mod size;
