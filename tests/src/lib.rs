//! Cross-crate integration and end-to-end tests live in `tests/tests/`.
