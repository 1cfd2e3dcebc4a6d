//! Process-wide logging set-up (its own binary: one global subscriber).

use ublk_metrics::events::{init_logging, LogFormat, LogInitError};

#[test]
fn bad_filters_are_named_and_a_second_init_is_refused() {
    match init_logging(LogFormat::Json, "ublkd=notalevel") {
        Err(LogInitError::Filter { filter, .. }) => assert_eq!(filter, "ublkd=notalevel"),
        other => panic!("expected a filter error, got {other:?}"),
    }
    let control = init_logging(LogFormat::Json, "info").expect("first init");
    assert_eq!(control.filter(), "info");
    assert!(
        control.set_filter("debug").unwrap(),
        "a new filter is applied"
    );
    assert!(
        !control.set_filter("debug").unwrap(),
        "the same filter is no change"
    );
    assert!(tracing::enabled!(tracing::Level::DEBUG));
    assert!(matches!(
        control.set_filter("x=loud"),
        Err(LogInitError::Filter { .. })
    ));
    assert_eq!(control.filter(), "debug", "a bad filter leaves the old one");
    control.set_filter("warn").unwrap();
    assert!(!tracing::enabled!(tracing::Level::INFO));
    assert!(matches!(
        init_logging(LogFormat::Text, "info"),
        Err(LogInitError::AlreadySet)
    ));
}
