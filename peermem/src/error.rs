//! Errors of the peer-memory layer.

use std::io;

/// Errors of the peer-memory providers, registration and cache.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A system call failed.
    #[error("{call} failed ({context}): {hint} [{source}]")]
    Sys {
        /// The failing call.
        call: &'static str,
        /// What was being done.
        context: String,
        /// What it means / what to do.
        hint: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Bad argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The memory cannot be had on this machine, with the precise reason and the fix.
    #[error("{what}: {reason} (fix: {fix})")]
    Unavailable {
        /// What was asked for.
        what: String,
        /// Why it cannot be had.
        reason: String,
        /// What a user can do about it.
        fix: String,
    },
    /// The memory was freed, moved or removed: it must not be touched again.
    #[error("{0}: the memory is no longer valid (freed, moved or removed); register it again")]
    Invalidated(String),
    /// A CUDA driver call failed.
    #[error("{what}: {source}")]
    Cuda {
        /// What was being done.
        what: String,
        /// The driver's error.
        #[source]
        source: crate::cuda::CuError,
    },
    /// A verbs call failed.
    #[error(transparent)]
    Verbs(#[from] verbs::Error),
}

pub(crate) fn sys(call: &'static str, context: impl Into<String>, hint: &'static str) -> Error {
    Error::Sys {
        call,
        context: context.into(),
        hint,
        source: io::Error::last_os_error(),
    }
}

impl Error {
    /// The errno, when the OS gave one.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Sys { source, .. } => source.raw_os_error(),
            Error::Verbs(v) => v.raw_os_error(),
            _ => None,
        }
    }
}
