//! Rebuilds the crate when a migration is added or changed: `sqlx::migrate!` embeds `migrations/` at compile time.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
