//! Raw bytes off the wire: the frame decoder, the hello, then the session.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bridge::fuzzing::frames(data));
