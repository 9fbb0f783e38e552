//! The job kinds Conveyor ships, one file each, defined through the public library API exactly as another service
//! defines its own ([`crate::JobKind`], [`crate::Handler`]).

mod verify_credentials;

pub use verify_credentials::{VerifyCredentials, VerifyCredentialsHandler};
