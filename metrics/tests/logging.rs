//! Process-wide logging set-up (its own binary: one global subscriber).

use ublk_metrics::events::{init_logging, LogFormat, LogInitError};

#[test]
fn bad_filters_are_named_and_a_second_init_is_refused() {
    match init_logging(LogFormat::Json, "ublkd=notalevel") {
        Err(LogInitError::Filter { filter, .. }) => assert_eq!(filter, "ublkd=notalevel"),
        other => panic!("expected a filter error, got {other:?}"),
    }
    init_logging(LogFormat::Json, "info").expect("first init");
    assert!(matches!(
        init_logging(LogFormat::Text, "info"),
        Err(LogInitError::AlreadySet)
    ));
}
