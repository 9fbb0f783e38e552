//! External systems behind traits, each with an HTTP implementation and a sandbox server that ships with Conveyor.

pub mod ai;
mod answer;
pub mod catalog;
pub mod fetch;
pub mod marketplace;
pub mod sandbox;
pub mod tls;
