//! Entry points for the fuzzers (feature `fuzzing`, used by `fuzz/`): each takes arbitrary
//! bytes and panics only when a rule of the protocol is broken — a request that reaches outside
//! a region, a put through a handle opened for reading, a handle given twice, a limit passed,
//! a decoder that buffers more than a frame, a message that does not survive its own encoding.

use crate::protocol::{encode, Decoder, Msg, MAX_FRAME, MAX_HELLO_FRAME};
use crate::server::session::check_hello;
use crate::server::testkit::{Model, Script};
use crate::token::{Grant, Scope, Token};

/// The token the fuzzers' hellos must carry to get past authentication (every region).
pub const TOKEN: &str = "fuzz-token";

/// A second token, scoped: `rw` for reading, `held` for writing.
pub const READER_TOKEN: &str = "fuzz-reader";

fn reader_scope() -> Scope {
    Scope::Regions(vec![("rw".into(), false), ("held".into(), true)])
}

/// A structured session: the bytes are read as requests (aimed at live handles and region
/// edges) of a client that is already authenticated; the first byte decides when the server
/// starts draining and whether the client's token is scoped.
pub fn session(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let drain_after = (first >> 2) as usize;
    let mut model = if first & 2 == 2 {
        Model::scoped(reader_scope())
    } else {
        Model::new()
    };
    let mut script = Script::new(rest);
    let mut n = 0;
    while let Some(m) = script.next_msg() {
        if first & 1 == 1 && n == drain_after {
            model.drain();
        }
        model.apply(m);
        script.live = model.live();
        n += 1;
    }
}

/// Raw bytes off the wire: the first byte picks how they are cut into reads; frames are decoded
/// with the server's limits (4 KiB before the hello, 1 MiB after), the first message must be a
/// hello with [`TOKEN`], and every later message goes to a session.
pub fn frames(data: &[u8]) {
    let Some((&cut, rest)) = data.split_first() else {
        return;
    };
    let step = usize::from(cut % 64) + 1;
    let mut d = Decoder::new();
    d.set_max_frame(MAX_HELLO_FRAME);
    let mut limit = MAX_HELLO_FRAME;
    let mut model: Option<Model> = None;
    let grants = [
        Grant::all(TOKEN),
        Grant {
            token: Token::new(READER_TOKEN),
            scope: reader_scope(),
        },
    ];
    for piece in rest.chunks(step) {
        d.feed(piece);
        loop {
            let m = match d.next_msg() {
                Ok(Some(m)) => m,
                Ok(None) => break,
                // the connection is refused and closed
                Err(_) => return,
            };
            let mut back = Decoder::new();
            back.set_max_frame(usize::MAX);
            back.feed(&encode(&m));
            let again = back.next_msg().expect("our own encoding decodes");
            assert_eq!(
                again.as_ref(),
                Some(&m),
                "a message changed through its encoding"
            );
            match &mut model {
                None => match check_hello(m, &grants) {
                    Ok((_, scope)) => {
                        model = Some(Model::scoped(scope));
                        limit = MAX_FRAME;
                        d.set_max_frame(MAX_FRAME);
                    }
                    Err(_) => return,
                },
                Some(model) => {
                    if matches!(m, Msg::Bye) {
                        return;
                    }
                    model.apply(m);
                }
            }
        }
        assert!(
            d.buffered() <= limit + 4,
            "the decoder holds {} bytes, over a frame",
            d.buffered()
        );
    }
}
