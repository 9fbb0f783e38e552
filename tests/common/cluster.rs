//! A real Redis Cluster on loopback for one test: six `redis-server` processes (three masters, one replica each) on
//! free ports, joined by `redis-cli --cluster create`, with a way to SIGKILL the master that owns a key and wait for
//! its replica to take over. And a Sentinel setup: a master, its replica and one sentinel (`redis-server
//! --sentinel`), with a way to SIGKILL the master and wait for the sentinel's failover. Dropping either kills every
//! process and removes its directory.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{eventually, free_port};

/// One node: its client port, its cluster bus port, its process (None once killed).
struct Node {
    port: u16,
    child: Option<Child>,
}

/// A running Redis Cluster.
pub struct RedisCluster {
    dir: PathBuf,
    nodes: Vec<Node>,
}

/// Runs `redis-cli -p <port> <args>` and returns its output (empty when the node does not answer).
fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stderr(Stdio::null())
        .output()
        .expect("redis-cli is installed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
pub struct NodeLine {
    /// Node id.
    pub id: String,
    /// Client port.
    pub port: u16,
    /// Whether it is a master (and not failed).
    pub master: bool,
    /// Whether the cluster sees it as failed.
    pub failed: bool,
    /// Slot ranges it serves (masters), inclusive.
    pub slots: Vec<(u16, u16)>,
}

fn parse_nodes(text: &str) -> Vec<NodeLine> {
    text.lines()
        .filter_map(|line| {
            let parts: Vec<&str> = line.split_whitespace().collect();
            if parts.len() < 8 {
                return None;
            }
            let port = parts[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
            let flags = parts[2];
            let slots = parts[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|n| (n, n)),
                })
                .collect();
            Some(NodeLine {
                id: parts[0].to_owned(),
                port,
                master: flags.contains("master"),
                failed: flags.contains("fail") && !flags.contains("fail?"),
                slots,
            })
        })
        .collect()
}

impl Node {
    /// Starts one cluster-enabled `redis-server` on free ports and waits until it answers. A port taken by another
    /// test between `free_port` and the server's bind makes the server exit: it is started again on other ports.
    async fn start(dir: &std::path::Path) -> Node {
        for _ in 0..5 {
            let (port, bus) = (free_port(), free_port());
            let mut child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--cluster-enabled", "yes"])
                .args(["--cluster-port", &bus.to_string()])
                .args(["--cluster-config-file", &dir.join(format!("nodes-{port}.conf")).display().to_string()])
                .args(["--cluster-node-timeout", "2000", "--save", "", "--appendonly", "no"])
                .args(["--dir", &dir.display().to_string(), "--dbfilename", &format!("dump-{port}.rdb")])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server is installed");
            let answered = eventually(Duration::from_secs(20), || {
                let exited = child.try_wait().ok().flatten().is_some();
                async move {
                    if exited {
                        return Some(false);
                    }
                    cli(port, &["PING"]).contains("PONG").then_some(true)
                }
            })
            .await;
            if answered == Some(true) {
                return Node { port, child: Some(child) };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("no cluster node answered after five starts on free ports");
    }
}

impl RedisCluster {
    /// Starts six nodes, creates the cluster (three masters with a replica each) and waits until every node says
    /// `cluster_state:ok` and agrees on who serves every slot.
    pub async fn start() -> Self {
        let dir = std::env::temp_dir().join(format!("conveyor-cluster-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut nodes = Vec::new();
        for _ in 0..6 {
            nodes.push(Node::start(&dir).await);
        }
        let cluster = Self { dir, nodes };
        let addrs: Vec<String> = cluster.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli is installed");
        assert!(
            created.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&created.stdout)
        );
        cluster.wait_ok().await;
        eventually(Duration::from_secs(30), || async {
            let masters = cluster.masters();
            (masters.len() == 3 && cluster.replicas_in_sync()).then_some(())
        })
        .await
        .expect("three masters, each with a replica in sync");
        cluster
    }

    /// `redis-cluster://127.0.0.1:p1,127.0.0.1:p2,...`: every node as a seed.
    pub fn url(&self) -> String {
        let addrs: Vec<String> = self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        format!("redis-cluster://{}", addrs.join(","))
    }

    /// The ports of the nodes still running.
    pub fn live_ports(&self) -> Vec<u16> {
        self.nodes.iter().filter(|n| n.child.is_some()).map(|n| n.port).collect()
    }

    /// `CLUSTER NODES` as one live node sees it.
    pub fn nodes(&self) -> Vec<NodeLine> {
        for port in self.live_ports() {
            let text = cli(port, &["CLUSTER", "NODES"]);
            if !text.trim().is_empty() {
                return parse_nodes(&text);
            }
        }
        Vec::new()
    }

    /// The live masters that serve slots.
    pub fn masters(&self) -> Vec<NodeLine> {
        let live = self.live_ports();
        self.nodes()
            .into_iter()
            .filter(|n| n.master && !n.failed && !n.slots.is_empty() && live.contains(&n.port))
            .collect()
    }

    fn replicas_in_sync(&self) -> bool {
        self.live_ports().iter().all(|&port| {
            let info = cli(port, &["INFO", "replication"]);
            !info.contains("role:slave") || info.contains("master_link_status:up")
        })
    }

    /// The slot of `key`.
    pub fn keyslot(&self, key: &str) -> u16 {
        let port = self.live_ports()[0];
        cli(port, &["CLUSTER", "KEYSLOT", key]).trim().parse().expect("CLUSTER KEYSLOT answers a number")
    }

    /// The port of the master serving `key`'s slot.
    pub fn master_of(&self, key: &str) -> u16 {
        let slot = self.keyslot(key);
        self.masters()
            .into_iter()
            .find(|m| m.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
            .map(|m| m.port)
            .expect("a live master serves every slot")
    }

    /// Waits until every live node says `cluster_state:ok`.
    pub async fn wait_ok(&self) {
        eventually(Duration::from_secs(30), || async {
            self.live_ports()
                .iter()
                .all(|&port| cli(port, &["CLUSTER", "INFO"]).contains("cluster_state:ok"))
                .then_some(())
        })
        .await
        .expect("cluster_state:ok on every node");
    }

    /// SIGKILLs the master serving `key`, waits for its replica to be promoted (another live master serves the slot
    /// and every live node says `cluster_state:ok`), and returns the killed port.
    pub async fn kill_master_of(&mut self, key: &str) -> u16 {
        let port = self.master_of(key);
        let node = self.nodes.iter_mut().find(|n| n.port == port).expect("the master is one of ours");
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let slot = self.keyslot(key);
        eventually(Duration::from_secs(30), || async {
            let promoted = self
                .masters()
                .into_iter()
                .any(|m| m.port != port && m.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)));
            promoted.then_some(())
        })
        .await
        .expect("the replica took over the killed master's slots");
        self.wait_ok().await;
        port
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A master, its replica and one sentinel watching them as service `main`.
pub struct RedisSentinel {
    dir: PathBuf,
    master: Node,
    replica: Node,
    sentinel: Node,
}

fn spawn_server(args: &[String]) -> Child {
    Command::new("redis-server")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server is installed")
}

impl RedisSentinel {
    /// Starts the three processes and waits until the sentinel knows the master and its replica is in sync.
    pub async fn start() -> Self {
        let dir = std::env::temp_dir().join(format!("conveyor-sentinel-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let (m, r, s) = (free_port(), free_port(), free_port());
        let base = |port: u16| {
            vec![
                "--port".to_owned(),
                port.to_string(),
                "--bind".to_owned(),
                "127.0.0.1".to_owned(),
                "--save".to_owned(),
                String::new(),
                "--appendonly".to_owned(),
                "no".to_owned(),
                "--dir".to_owned(),
                dir.display().to_string(),
                "--dbfilename".to_owned(),
                format!("dump-{port}.rdb"),
            ]
        };
        let master = spawn_server(&base(m));
        let mut replica_args = base(r);
        replica_args.extend(["--replicaof".to_owned(), "127.0.0.1".to_owned(), m.to_string()]);
        let replica = spawn_server(&replica_args);
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {s}\nbind 127.0.0.1\ndir {}\nsentinel monitor main 127.0.0.1 {m} 1\n\
                 sentinel down-after-milliseconds main 1000\nsentinel failover-timeout main 5000\n",
                dir.display()
            ),
        )
        .unwrap();
        let sentinel = spawn_server(&[conf.display().to_string(), "--sentinel".to_owned()]);
        let setup = Self {
            dir,
            master: Node { port: m, child: Some(master) },
            replica: Node { port: r, child: Some(replica) },
            sentinel: Node { port: s, child: Some(sentinel) },
        };
        eventually(Duration::from_secs(30), || async {
            let synced = cli(r, &["INFO", "replication"]).contains("master_link_status:up");
            let known = cli(s, &["SENTINEL", "replicas", "main"]).contains(&r.to_string());
            (synced && known && setup.master_port_by_sentinel() == Some(m)).then_some(())
        })
        .await
        .expect("the sentinel watches a master whose replica is in sync");
        setup
    }

    /// `redis-sentinel://127.0.0.1:<sentinel>/0?sentinelServiceName=main`.
    pub fn url(&self) -> String {
        format!("redis-sentinel://127.0.0.1:{}/0?sentinelServiceName=main", self.sentinel.port)
    }

    /// The master's port as the sentinel names it.
    pub fn master_port_by_sentinel(&self) -> Option<u16> {
        let out = cli(self.sentinel.port, &["SENTINEL", "get-master-addr-by-name", "main"]);
        out.lines().nth(1).and_then(|p| p.trim().parse().ok())
    }

    /// SIGKILLs the master and waits until the sentinel has promoted the replica (and the replica says so).
    pub async fn kill_master(&mut self) -> u16 {
        let killed = self.master.port;
        if let Some(mut child) = self.master.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let replica = self.replica.port;
        eventually(Duration::from_secs(60), || async {
            let promoted = self.master_port_by_sentinel() == Some(replica)
                && cli(replica, &["INFO", "replication"]).contains("role:master");
            promoted.then_some(())
        })
        .await
        .expect("the sentinel promoted the replica");
        killed
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        for node in [&mut self.master, &mut self.replica, &mut self.sentinel] {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
