#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    target_rdma::fuzzing::run("hello", target_rdma_fuzz::scratch(), data);
});
