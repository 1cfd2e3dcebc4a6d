//! The production path: the recorder installed process-wide. Its own test
//! binary, because a process has one global recorder.

use ublk_metrics::{Daemon, IoMetrics, IoOp, Telemetry, TelemetryError};

#[test]
fn installed_recorder_renders_handles_and_refuses_a_second_install() {
    let t = Telemetry::install(Daemon::Ublkd, "1.2.3").expect("first install");
    let io = IoMetrics::new(&t, "mem", None).unwrap();
    io.record(
        IoOp::Write,
        512,
        Ok(()),
        std::time::Duration::from_micros(70),
    );
    let text = t.render().unwrap();
    assert!(
        text.contains("ublk_io_bytes_total{target=\"mem\",op=\"write\"} 512"),
        "{text}"
    );
    assert!(
        text.contains("ublkd_build_info{version=\"1.2.3\",revision=\""),
        "{text}"
    );
    assert!(matches!(
        Telemetry::install(Daemon::Ublkd, "1.2.3"),
        Err(TelemetryError::Install(_))
    ));
}
