//! [`SettingsError`]: a component's settings that do not hold together.

/// Settings refused by a component's `validate()`: which one, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{setting}` {reason}")]
#[non_exhaustive]
pub struct SettingsError {
    /// The field refused.
    pub setting: &'static str,
    /// Why, naming in backticks any other field it was compared with.
    pub reason: String,
}

impl SettingsError {
    /// `setting` is refused for `reason`.
    pub fn new(setting: &'static str, reason: impl Into<String>) -> Self {
        Self { setting, reason: reason.into() }
    }
}
