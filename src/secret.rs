//! [`Secret`]: a value kept out of logs and zeroed when dropped.

use std::fmt;

/// A value that must never be printed: `Debug`/`Display` show `[redacted]`, and the bytes are zeroed on drop.
#[derive(Clone)]
pub struct Secret<T: zeroize::Zeroize>(T);

impl<T: zeroize::Zeroize> Secret<T> {
    /// Wraps a secret value.
    pub fn new(value: T) -> Self {
        Self(value)
    }
    /// The secret itself, for the one place that must use it.
    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl<T: zeroize::Zeroize> Drop for Secret<T> {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

impl<T: zeroize::Zeroize> fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl<T: zeroize::Zeroize> fmt::Display for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}
