//! The four roles of one run (`api`, `dispatcher`, `worker`, `maintenance`), each a real `conveyor` process with an
//! admin address of its own, as the drills (Redis Cluster, PostgreSQL faults) start them.

use std::collections::HashMap;

use super::{Process, free_port};

/// Short intervals, so that sweeps, maintenance and the reconciler act within a test's patience, and small pools: four
/// processes share the test's PostgreSQL with every other test.
pub fn quick_intervals(vars: &mut HashMap<String, String>) {
    for (name, value) in [
        ("CONVEYOR_DATABASE_MAX_CONNECTIONS", "8"),
        ("CONVEYOR_WORKER_CONCURRENCY", "8"),
        ("CONVEYOR_DISPATCH_POLL", "200ms"),
        ("CONVEYOR_MAINTENANCE_INTERVAL", "1s"),
        ("CONVEYOR_OPERATION_KEEPALIVE", "2s"),
        ("CONVEYOR_RECONCILE_AFTER", "10s"),
        ("RUST_LOG", "info"),
    ] {
        vars.insert(name.into(), value.into());
    }
}

/// The running roles, and the API's port.
pub struct Roles {
    pub api_port: u16,
    pub processes: Vec<(&'static str, Process)>,
}

impl Roles {
    /// Starts every role with `vars`, the API on a free port.
    pub fn spawn(vars: &HashMap<String, String>) -> Self {
        Self::spawn_each(vars, |_, _| {})
    }

    /// Starts every role with `vars` as `tweak` changes them for that role, the API on a free port.
    pub fn spawn_each(vars: &HashMap<String, String>, tweak: impl Fn(&str, &mut HashMap<String, String>)) -> Self {
        let api_port = free_port();
        let mut processes = Vec::new();
        for role in ["api", "dispatcher", "worker", "maintenance"] {
            let mut vars = vars.clone();
            tweak(role, &mut vars);
            vars.insert("CONVEYOR_HTTP_ADDR".into(), format!("127.0.0.1:{api_port}"));
            vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", free_port()));
            processes.push((role, Process::spawn(&[role], &vars)));
        }
        Self { api_port, processes }
    }

    /// The roles whose process has exited.
    pub fn exited(&mut self) -> Vec<String> {
        self.processes
            .iter_mut()
            .filter_map(|(role, p)| p.child.try_wait().ok().flatten().map(|status| format!("{role} ({status})")))
            .collect()
    }

    /// The log of `role`.
    pub fn log(&self, role: &str) -> String {
        self.processes.iter().find(|(r, _)| *r == role).map(|(_, p)| p.log()).unwrap_or_default()
    }

    /// The end of every process's log, for a failure message.
    pub fn logs(&self) -> String {
        self.processes.iter().map(|(role, p)| format!("----- {role}\n{}\n", tail(&p.log(), 50))).collect()
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
