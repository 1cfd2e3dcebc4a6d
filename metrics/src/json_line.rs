//! The daemons' JSON log line: what `tracing_subscriber`'s JSON format
//! writes with `flatten_event(true)` and `with_target(false)` (timestamp,
//! level, then the event's fields in order), byte for byte, at half its
//! cost.
//!
//! The stock format hands serde_json a writer that turns every token (a
//! quote, a key, a colon) into a UTF-8 check and a dynamic `write_str`;
//! a retained trace's two span lines cost ~17 us that way on the bench host,
//! +1.4% per I/O at the default sample rate (docs/BENCHMARKS.md). Here the
//! line is serialized into a byte buffer and written once.
//!
//! The daemons open no `tracing` spans, so the stock format's `span` and
//! `spans` keys are not written.

use serde::ser::{SerializeMap, Serializer as _};
use std::fmt::{self, Write as _};
use tracing::field::{Field, Visit};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The JSON line event format ([`crate::events::json_subscriber`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonLine;

type Map<'a> = serde_json::ser::Compound<'a, &'a mut Vec<u8>, serde_json::ser::CompactFormatter>;

/// Writes each field as one map entry; stops at the first error.
struct Fields<'a> {
    map: Map<'a>,
    /// A `Debug` or `Display` field's text, formatted whole so it is
    /// escaped in one pass.
    text: String,
    result: Result<(), serde_json::Error>,
}

impl Fields<'_> {
    fn entry(&mut self, field: &Field, value: &(impl serde::Serialize + ?Sized)) {
        if self.result.is_ok() {
            self.result = self.map.serialize_entry(field.name(), value);
        }
    }
}

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let mut text = std::mem::take(&mut self.text);
        text.clear();
        // Writing to a String fails only if `value`'s own `Debug` does.
        if write!(text, "{value:?}").is_ok() {
            self.entry(field, text.as_str());
        }
        self.text = text;
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.entry(field, value);
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.entry(field, &value);
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.entry(field, &value);
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.entry(field, &value);
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.entry(field, &value);
    }
}

impl<S, N> FormatEvent<S, N> for JsonLine
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'w> FormatFields<'w> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> fmt::Result {
        // Sized for the timestamp, a line and a trace id: one allocation
        // each.
        let mut timestamp = String::with_capacity(32);
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        let mut line = Vec::with_capacity(512);
        let mut ser = serde_json::Serializer::new(&mut line);
        let mut map = ser.serialize_map(None).map_err(|_| fmt::Error)?;
        map.serialize_entry("timestamp", &timestamp)
            .and_then(|()| map.serialize_entry("level", event.metadata().level().as_str()))
            .map_err(|_| fmt::Error)?;
        let mut fields = Fields {
            map,
            text: String::with_capacity(64),
            result: Ok(()),
        };
        event.record(&mut fields);
        fields
            .result
            .and_then(|()| SerializeMap::end(fields.map))
            .map_err(|_| fmt::Error)?;
        // serde_json writes UTF-8 only.
        writer.write_str(std::str::from_utf8(&line).map_err(|_| fmt::Error)?)?;
        writeln!(writer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[derive(Clone, Default)]
    struct Buf(Arc<parking_lot::Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Event names of the samples below; the formatter's bytes do not
    /// depend on which names they are.
    const SAMPLE: &str = "sample.logged";
    const FILTERED: &str = "sample.filtered";

    /// Every field type, escapes, a formatted message and a level filter.
    fn events() {
        tracing::info!(
            event = SAMPLE,
            trace_id = %format_args!("{:032x}", 0xabc_u128),
            corr = 42u64,
            device = -1i64,
            ok = true,
            ratio = 0.25f64,
            nan = f64::NAN,
            target = "ar\"ena\\\n\u{1}é",
            list = ?["a", "b\"c"],
            "request span {}",
            7
        );
        tracing::warn!(event = SAMPLE, latency_ms = 5u64);
        tracing::debug!(event = FILTERED);
        tracing::error!("message only");
    }

    fn lines(format: impl FnOnce(Buf) -> tracing::Dispatch) -> String {
        let buf = Buf::default();
        tracing::dispatcher::with_default(&format(buf.clone()), events);
        let text = String::from_utf8(buf.0.lock().clone()).expect("utf-8");
        // The timestamps differ between the runs: keep everything after.
        text.lines()
            .map(|l| {
                let (ts, rest) = l
                    .split_once(",\"level\"")
                    .expect("a level after the timestamp");
                assert!(ts.starts_with("{\"timestamp\":\"20"), "{ts}");
                assert!(ts.ends_with("Z\""), "{ts}");
                format!("{rest}\n")
            })
            .collect()
    }

    #[test]
    fn writes_what_the_stock_json_format_writes() {
        let ours = lines(|b| {
            tracing_subscriber::fmt()
                .with_env_filter("info")
                .with_writer(move || b.clone())
                .event_format(JsonLine)
                .finish()
                .into()
        });
        let stock = lines(|b| {
            tracing_subscriber::fmt()
                .with_env_filter("info")
                .with_writer(move || b.clone())
                .json()
                .flatten_event(true)
                .with_target(false)
                .finish()
                .into()
        });
        assert_eq!(ours.lines().count(), 3, "{ours}");
        assert_eq!(ours, stock);
        for l in ours.lines() {
            let v: serde_json::Value =
                serde_json::from_str(&format!("{{\"level\"{l}")).expect("a JSON object");
            assert!(v["level"].is_string(), "{l}");
        }
    }
}
