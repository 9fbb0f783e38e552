//! The job kinds Conveyor ships, one file each, defined through the public library API exactly as another service
//! defines its own ([`conveyor_jobs::JobKind`], [`conveyor_jobs::Handler`]).

mod generate_ai;
mod process_media;
mod publish_listing;
mod sync_catalog;
mod transfer_asset;
mod verify_credentials;

pub use generate_ai::{GenerateAi, GenerateAiHandler};
pub use process_media::{ProcessMedia, ProcessMediaHandler};
pub use publish_listing::{PublishListing, PublishListingHandler};
pub use sync_catalog::{SyncCatalog, SyncCatalogHandler};
pub use transfer_asset::{TransferAsset, TransferAssetHandler};
pub use verify_credentials::{VerifyCredentials, VerifyCredentialsHandler};
