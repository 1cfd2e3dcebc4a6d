#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| target_rdma_fuzz::check_ublkd_config(data));
