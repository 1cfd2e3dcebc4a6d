#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    target_rdma::fuzzing::run("checkpoint", target_rdma_fuzz::scratch(), data);
});
