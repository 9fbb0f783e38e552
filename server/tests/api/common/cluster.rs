//! A real Redis Cluster on loopback for one test: six `redis-server` processes (three masters, one replica each) on
//! free ports, joined by `redis-cli --cluster create`, with a way to kill a master (the one that owns a key, or any)
//! and wait for its replica to take over. And a Sentinel setup: a master, its replica and one or three sentinels
//! (`redis-server --sentinel`), with a way to kill the master or a sentinel and wait for the failover. Dropping either
//! kills every process and removes its directory. Either may speak TLS only (`start_tls`): to its clients, who must
//! present a certificate, and between its own processes (cluster bus, replication, sentinels).
//!
//! A node dies one of two ways ([`Death`]). SIGKILLed on loopback, its connections are reset and its port refuses at
//! once, so clients learn of the death in microseconds. A host that dies (power, kernel, network) or a node that hangs
//! tells its clients nothing: their connections hang, new ones get no answer. That is [`Death::Silent`]: the process
//! is stopped (SIGSTOP), so the kernel keeps its sockets open and accepts connections that nothing answers (as a hung
//! node's kernel does; a dead host's does not even accept them, which costs a client the same wait), and it is
//! SIGKILLed when the setup is dropped.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{RedisServerTls, eventually, free_port};

/// One node: its client port, its process (None once killed), whether it is stopped (dead to its clients).
struct Node {
    port: u16,
    child: Option<Child>,
    stopped: bool,
}

/// How a node dies (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Death {
    /// SIGKILL: its connections are reset, its port refuses.
    Sigkill,
    /// SIGSTOP, SIGKILL at the end: its connections hang, its port accepts and never answers.
    Silent,
}

impl Node {
    /// Kills the node as `death` says; it no longer counts as live.
    fn kill(&mut self, death: Death) {
        match death {
            Death::Sigkill => {
                if let Some(mut child) = self.child.take() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
            Death::Silent => {
                if let Some(child) = &self.child {
                    let stopped = Command::new("kill").args(["-STOP", &child.id().to_string()]).status();
                    assert!(stopped.is_ok_and(|s| s.success()), "SIGSTOP reached redis-server {}", self.port);
                    self.stopped = true;
                }
            }
        }
    }

    fn live(&self) -> bool {
        self.child.is_some() && !self.stopped
    }
}

/// A running Redis Cluster.
pub struct RedisCluster {
    dir: PathBuf,
    nodes: Vec<Node>,
    /// Set when every node speaks TLS only (clients, the cluster bus and replication alike).
    tls: Option<RedisServerTls>,
}

/// Runs `redis-cli -p <port> <args>` (over TLS with `tls`) and returns its output (empty when the node does not
/// answer).
fn cli(tls: Option<&RedisServerTls>, port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(tls.map(RedisServerTls::cli_args).unwrap_or_default())
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
    /// Starts one cluster-enabled `redis-server` on free ports (TLS only with `tls`, its cluster bus too) and waits
    /// until it answers. A port taken by another test between `free_port` and the server's bind makes the server
    /// exit: it is started again on other ports.
    async fn start(dir: &std::path::Path, tls: Option<&RedisServerTls>) -> Node {
        for _ in 0..5 {
            let (port, bus) = (free_port(), free_port());
            let listen = match tls {
                None => vec!["--port".to_owned(), port.to_string()],
                Some(tls) => {
                    let mut args = tls.server_args(port);
                    args.extend(["--tls-cluster", "yes", "--tls-replication", "yes"].map(str::to_owned));
                    args
                }
            };
            let mut child = Command::new("redis-server")
                .args(listen)
                .args(["--bind", "127.0.0.1", "--cluster-enabled", "yes"])
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
                    cli(tls, port, &["PING"]).contains("PONG").then_some(true)
                }
            })
            .await;
            if answered == Some(true) {
                return Node { port, child: Some(child), stopped: false };
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
        Self::start_with(None).await
    }

    /// [`RedisCluster::start`] with every node speaking TLS only, with `tls`'s files: to clients (who must present a
    /// certificate), on the cluster bus and between master and replica.
    pub async fn start_tls(tls: RedisServerTls) -> Self {
        Self::start_with(Some(tls)).await
    }

    async fn start_with(tls: Option<RedisServerTls>) -> Self {
        let dir = std::env::temp_dir().join(format!("conveyor-cluster-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut nodes = Vec::new();
        for _ in 0..6 {
            nodes.push(Node::start(&dir, tls.as_ref()).await);
        }
        // In port order: `--cluster create` makes the first three masters, so the lowest address is a master's.
        nodes.sort_by_key(|n| n.port);
        let cluster = Self { dir, nodes, tls };
        let addrs: Vec<String> = cluster.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let created = Command::new("redis-cli")
            .args(cluster.tls.as_ref().map(RedisServerTls::cli_args).unwrap_or_default())
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

    /// `redis-cluster://127.0.0.1:p1,127.0.0.1:p2,...` (`rediss-cluster://` over TLS): every node as a seed.
    pub fn url(&self) -> String {
        let addrs: Vec<String> = self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        format!("{}://{}", self.scheme(), addrs.join(","))
    }

    fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "rediss-cluster" } else { "redis-cluster" }
    }

    fn cli(&self, port: u16, args: &[&str]) -> String {
        cli(self.tls.as_ref(), port, args)
    }

    /// A URL naming every node with `first` as its first seed (the others in start order): as a comma list
    /// (`redis-cluster://a,b,c`) when `commas`, else in fred's form (`redis-cluster://a?node=b&node=c`).
    pub fn url_led_by(&self, first: u16, commas: bool) -> String {
        let mut ports: Vec<u16> = self.nodes.iter().map(|n| n.port).collect();
        ports.sort_by_key(|&p| p != first);
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        if commas {
            format!("{}://{}", self.scheme(), addrs.join(","))
        } else {
            let nodes: Vec<String> = addrs[1..].iter().map(|a| format!("node={a}")).collect();
            format!("{}://{}?{}", self.scheme(), addrs[0], nodes.join("&"))
        }
    }

    /// The ports of the nodes still running (and not stopped).
    pub fn live_ports(&self) -> Vec<u16> {
        self.nodes.iter().filter(|n| n.live()).map(|n| n.port).collect()
    }

    /// `CLUSTER NODES` as one live node sees it.
    pub fn nodes(&self) -> Vec<NodeLine> {
        for port in self.live_ports() {
            let text = self.cli(port, &["CLUSTER", "NODES"]);
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
            let info = self.cli(port, &["INFO", "replication"]);
            !info.contains("role:slave") || info.contains("master_link_status:up")
        })
    }

    /// The slot of `key`.
    pub fn keyslot(&self, key: &str) -> u16 {
        let port = self.live_ports()[0];
        self.cli(port, &["CLUSTER", "KEYSLOT", key]).trim().parse().expect("CLUSTER KEYSLOT answers a number")
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
                .all(|&port| self.cli(port, &["CLUSTER", "INFO"]).contains("cluster_state:ok"))
                .then_some(())
        })
        .await
        .expect("cluster_state:ok on every node");
    }

    /// SIGKILLs the master serving `key`, waits for its replica to be promoted (another live master serves the slot
    /// and every live node says `cluster_state:ok`), and returns the killed port.
    pub async fn kill_master_of(&mut self, key: &str) -> u16 {
        let port = self.master_of(key);
        self.kill_master(port, Death::Sigkill).await;
        port
    }

    /// Kills the master on `port` as `death` says and waits until its replica serves its slots and every live node
    /// says `cluster_state:ok`.
    pub async fn kill_master(&mut self, port: u16, death: Death) {
        let master = self.masters().into_iter().find(|m| m.port == port).expect("a live master serving slots");
        let slot = master.slots[0].0;
        self.nodes.iter_mut().find(|n| n.port == port).expect("the master is one of ours").kill(death);
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
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill(Death::Sigkill);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A master, its replica and one sentinel (quorum 1) or three (quorum 2) watching them as service `main`.
pub struct RedisSentinel {
    dir: PathBuf,
    master: Node,
    replica: Node,
    sentinels: Vec<Node>,
    /// Set when every server and sentinel speaks TLS only (to clients, and to each other).
    tls: Option<RedisServerTls>,
    /// The master's and the replica's password, if they require one.
    password: Option<String>,
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
    /// A master, its replica and one sentinel; see [`RedisSentinel::start_with`].
    pub async fn start() -> Self {
        Self::start_with(1).await
    }

    /// Starts the master, its replica and `sentinels` sentinels (quorum: a majority of them), and waits until every
    /// sentinel knows the master, its replica and the other sentinels, and the replica is in sync.
    pub async fn start_with(sentinels: usize) -> Self {
        Self::start_setup(sentinels, None, None).await
    }

    /// A master, its replica and three sentinels (quorum 2), each speaking TLS only with `tls`'s files: to clients
    /// (who must present a certificate), and to each other (replication, the sentinels' connections to the servers
    /// and to one another, which a failover's vote needs).
    pub async fn start_tls(tls: RedisServerTls) -> Self {
        Self::start_setup(3, Some(tls), None).await
    }

    /// A master and its replica that require `password` (the sentinel is given it, as `sentinel auth-pass`), and one
    /// sentinel that requires none.
    pub async fn start_with_password(password: &str) -> Self {
        Self::start_setup(1, None, Some(password)).await
    }

    /// Starts the setup; a port taken by another test between `free_port` and a process's bind makes that process
    /// exit at once: the whole setup is started again on other ports (at most five times).
    async fn start_setup(sentinels: usize, tls: Option<RedisServerTls>, password: Option<&str>) -> Self {
        for _ in 0..5 {
            if let Some(setup) = Self::try_start(sentinels, tls.clone(), password).await {
                return setup;
            }
        }
        panic!("no sentinel setup started after five starts on free ports");
    }

    /// One start: `None` when one of its processes exited at once (its port was taken).
    async fn try_start(sentinels: usize, tls: Option<RedisServerTls>, password: Option<&str>) -> Option<Self> {
        let dir = std::env::temp_dir().join(format!("conveyor-sentinel-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let (m, r) = (free_port(), free_port());
        let base = |port: u16| {
            let listen = match &tls {
                None => vec!["--port".to_owned(), port.to_string()],
                Some(tls) => {
                    let mut args = tls.server_args(port);
                    args.extend(["--tls-replication".to_owned(), "yes".to_owned()]);
                    args
                }
            };
            let rest = vec![
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
            ];
            let auth = match password {
                Some(p) => vec!["--requirepass".to_owned(), p.to_owned(), "--masterauth".to_owned(), p.to_owned()],
                None => Vec::new(),
            };
            [listen, rest, auth].concat()
        };
        let master = spawn_server(&base(m));
        let mut replica_args = base(r);
        replica_args.extend(["--replicaof".to_owned(), "127.0.0.1".to_owned(), m.to_string()]);
        let replica = spawn_server(&replica_args);
        let quorum = sentinels / 2 + 1;
        let sentinels: Vec<Node> = (0..sentinels)
            .map(|_| {
                let s = free_port();
                let conf = dir.join(format!("sentinel-{s}.conf"));
                let listen = match &tls {
                    None => format!("port {s}\n"),
                    Some(tls) => format!("{}tls-replication yes\n", tls.config_lines(s)),
                };
                std::fs::write(
                    &conf,
                    format!(
                        "{listen}bind 127.0.0.1\ndir {}\nsentinel monitor main 127.0.0.1 {m} {quorum}\n\
                         sentinel down-after-milliseconds main 1000\nsentinel failover-timeout main 5000\n{}",
                        dir.display(),
                        password.map(|p| format!("sentinel auth-pass main {p}\n")).unwrap_or_default(),
                    ),
                )
                .unwrap();
                let child = spawn_server(&[conf.display().to_string(), "--sentinel".to_owned()]);
                Node { port: s, child: Some(child), stopped: false }
            })
            .collect();
        let mut setup = Self {
            dir,
            master: Node { port: m, child: Some(master), stopped: false },
            replica: Node { port: r, child: Some(replica), stopped: false },
            sentinels,
            tls,
            password: password.map(str::to_owned),
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let nodes = [&mut setup.master, &mut setup.replica].into_iter().chain(setup.sentinels.iter_mut());
        let exited = nodes.filter_map(|n| n.child.as_mut()).any(|c| c.try_wait().ok().flatten().is_some());
        if exited {
            return None; // dropped: the others are killed and the directory removed
        }
        let others = setup.sentinels.len() - 1;
        eventually(Duration::from_secs(30), || async {
            let synced = setup.server_cli(r, &["INFO", "replication"]).contains("master_link_status:up");
            let known = setup.sentinels.iter().all(|s| {
                setup.cli(s.port, &["SENTINEL", "replicas", "main"]).contains(&r.to_string())
                    && setup.cli(s.port, &["SENTINEL", "sentinels", "main"]).lines().filter(|l| *l == "ip").count()
                        == others
            });
            (synced && known && setup.master_port_by_sentinel() == Some(m)).then_some(())
        })
        .await
        .expect("the sentinels watch a master whose replica is in sync, and know each other");
        Some(setup)
    }

    /// `redis-sentinel://127.0.0.1:<s1>,127.0.0.1:<s2>,.../0?sentinelServiceName=main`: every sentinel, in start
    /// order.
    pub fn url(&self) -> String {
        self.url_in(true)
    }

    /// Every sentinel in start order, as a comma list when `commas` ([`RedisSentinel::url`]), else in fred's form
    /// (`redis-sentinel://<s1>/0?sentinelServiceName=main&node=<s2>&node=<s3>`).
    pub fn url_in(&self, commas: bool) -> String {
        let hosts: Vec<String> = self.sentinels.iter().map(|s| format!("127.0.0.1:{}", s.port)).collect();
        let scheme = if self.tls.is_some() { "rediss-sentinel" } else { "redis-sentinel" };
        if commas {
            format!("{scheme}://{}/0?sentinelServiceName=main", hosts.join(","))
        } else {
            let nodes: String = hosts[1..].iter().map(|h| format!("&node={h}")).collect();
            format!("{scheme}://{}/0?sentinelServiceName=main{nodes}", hosts[0])
        }
    }

    fn cli(&self, port: u16, args: &[&str]) -> String {
        cli(self.tls.as_ref(), port, args)
    }

    /// [`Self::cli`] to the master or the replica, with their password if they require one.
    fn server_cli(&self, port: u16, args: &[&str]) -> String {
        match &self.password {
            Some(p) => self.cli(port, &[&["-a", p, "--no-auth-warning"], args].concat()),
            None => self.cli(port, args),
        }
    }

    /// The master's port as a live sentinel names it.
    pub fn master_port_by_sentinel(&self) -> Option<u16> {
        let sentinel = self.sentinels.iter().find(|s| s.live())?;
        let out = self.cli(sentinel.port, &["SENTINEL", "get-master-addr-by-name", "main"]);
        out.lines().nth(1).and_then(|p| p.trim().parse().ok())
    }

    /// Kills the sentinel the URL lists at `index` as `death` says.
    pub fn kill_sentinel(&mut self, index: usize, death: Death) -> u16 {
        self.sentinels[index].kill(death);
        self.sentinels[index].port
    }

    /// SIGKILLs the master and waits until the sentinels have promoted the replica (and the replica says so).
    pub async fn kill_master(&mut self) -> u16 {
        self.kill_master_by(Death::Sigkill).await
    }

    /// Kills the master as `death` says and waits until the sentinels have promoted the replica (and the replica
    /// says so).
    pub async fn kill_master_by(&mut self, death: Death) -> u16 {
        let killed = self.master.port;
        self.master.kill(death);
        let replica = self.replica.port;
        eventually(Duration::from_secs(60), || async {
            let promoted = self.master_port_by_sentinel() == Some(replica)
                && self.server_cli(replica, &["INFO", "replication"]).contains("role:master");
            promoted.then_some(())
        })
        .await
        .expect("the sentinels promoted the replica");
        killed
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        for node in [&mut self.master, &mut self.replica].into_iter().chain(self.sentinels.iter_mut()) {
            node.kill(Death::Sigkill);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
