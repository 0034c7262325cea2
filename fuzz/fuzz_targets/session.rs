//! The connection's protocol rules, past authentication, against a model.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bridge::fuzzing::session(data));
