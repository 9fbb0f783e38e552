//! Lua scripts that run on whichever node holds their keys. `EVALSHA` is cheap but only works where the script was
//! loaded, and Redis forgets scripts on a restart, and a replica promoted by a failover never had them (`SCRIPT LOAD`
//! is not replicated). So every call goes out as `EVALSHA`, routed by its first key; one answered `NOSCRIPT` is sent
//! again as `EVAL` with the script's text, which works on any node, and the script is loaded on every primary in the
//! background so that the next calls find it. Every script's keys share one hash tag: one slot, one node.
//!
//! The route is the first key's slot, computed here ([`routed_by`]): fred routes a custom command by the slot its
//! [`CustomCommand`] names (`ClusterHash::Custom`) and ignores any other policy there, hashing the first argument
//! instead, which for a script is its SHA-1 or its text. Each call then went to the node of that slot, was answered
//! `MOVED`, and made fred re-read the whole slot map before sending it again: one slot-map read per script call, and,
//! while a seed was dead, one wait on the dead seed per call (see [`super::connect_with`]).

use fred::prelude::{ClientLike, LuaInterface};
use fred::types::{ClusterHash, CustomCommand, FromValue};

use super::{RedisClient, Watched};

/// The cluster route of a command whose first key is `key`: that key's slot (`{tag}` hashing included).
pub(crate) fn routed_by(key: &str) -> ClusterHash {
    ClusterHash::Custom(fred::util::redis_keyslot(key.as_bytes()))
}

/// The route of a script call with `keys`: its first key's slot (every key of a call shares its hash tag).
fn route(keys: &[String]) -> ClusterHash {
    keys.first().map_or(ClusterHash::FirstKey, |key| routed_by(key))
}

/// A script and its SHA-1.
#[derive(Clone, Debug)]
pub(crate) struct LuaScript {
    body: &'static str,
    sha: String,
}

/// Whether Redis answered that it does not know the script.
pub(crate) fn is_noscript(e: &fred::error::Error) -> bool {
    e.details().starts_with("NOSCRIPT") || e.to_string().contains("NOSCRIPT")
}

impl LuaScript {
    /// The script `body`.
    pub(crate) fn new(body: &'static str) -> Self {
        Self { body, sha: fred::util::sha1_hash(body) }
    }

    /// `EVALSHA` as a custom command (pipelines take no typed one), routed by its first key.
    pub(crate) fn evalsha(&self, keys: Vec<String>, args: Vec<String>) -> (CustomCommand, Vec<String>) {
        (CustomCommand::new("EVALSHA", route(&keys), false), self.command(self.sha.clone(), keys, args))
    }

    /// `EVAL` with the script's text, routed by its first key: works on a node that never loaded the script.
    pub(crate) fn eval(&self, keys: Vec<String>, args: Vec<String>) -> (CustomCommand, Vec<String>) {
        (CustomCommand::new("EVAL", route(&keys), false), self.command(self.body.to_owned(), keys, args))
    }

    fn command(&self, script: String, keys: Vec<String>, args: Vec<String>) -> Vec<String> {
        let mut command = Vec::with_capacity(2 + keys.len() + args.len());
        command.push(script);
        command.push(keys.len().to_string());
        command.extend(keys);
        command.extend(args);
        command
    }

    /// Runs the script: `EVALSHA`, then `EVAL` if the node did not know it (and a load on every primary meanwhile).
    pub(crate) async fn run<R: FromValue>(
        &self,
        client: &RedisClient,
        keys: Vec<String>,
        args: Vec<String>,
    ) -> Result<R, fred::error::Error> {
        let (cmd, command) = self.evalsha(keys.clone(), args.clone());
        match client.custom(cmd, command).await.watched(client) {
            Err(e) if is_noscript(&e) => {
                self.load_everywhere(client);
                let (cmd, command) = self.eval(keys, args);
                client.custom(cmd, command).await.watched(client)
            }
            result => result,
        }
    }

    /// Loads the script on every primary (in a cluster) or on the server, in the background; a failure is only
    /// logged, since every call falls back to `EVAL` anyway.
    pub(crate) fn load_everywhere(&self, client: &RedisClient) {
        let (client, body) = (client.clone(), self.body);
        tokio::spawn(async move {
            if let Err(e) = client.script_load_cluster::<String, _>(body).await {
                tracing::debug!(error = %e, "Could not load a Lua script on every Redis primary; calls use EVAL");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evalsha_and_eval_name_the_same_keys_and_arguments_after_the_script() {
        let script = LuaScript::new("return 1");
        let (_, sha) = script.evalsha(vec!["{q}:a".into(), "{q}:b".into()], vec!["x".into()]);
        assert_eq!(sha, [fred::util::sha1_hash("return 1").as_str(), "2", "{q}:a", "{q}:b", "x"]);
        let (_, eval) = script.eval(vec!["{q}:a".into()], vec![]);
        assert_eq!(eval, ["return 1", "1", "{q}:a"]);
        let noscript = fred::error::Error::new(fred::error::ErrorKind::Unknown, "NOSCRIPT No matching script.");
        assert!(is_noscript(&noscript));
    }

    #[test]
    fn a_script_call_is_routed_by_the_slot_of_its_first_key_never_by_its_sha_or_text() {
        let script = LuaScript::new("return 1");
        let slot = fred::util::redis_keyslot(b"q");
        for (cmd, _) in [script.evalsha(vec!["p:{q}:a".into()], vec![]), script.eval(vec!["p:{q}:b".into()], vec![])] {
            assert_eq!(cmd.cluster_hash, ClusterHash::Custom(slot), "{}", cmd.cmd);
        }
        assert_ne!(fred::util::redis_keyslot(script.sha.as_bytes()), slot, "the SHA would have routed elsewhere");
    }
}
