//! A network partition heals without failing the job (issue 38): the roles
//! run in two network namespaces joined by a veth pair, each side with its
//! own address; the link goes down for longer than the heartbeat timeout,
//! then comes back. The role cut off takes the silence for a possible
//! death: it waits, registers again once the coordinator answers, and
//! rejoins the job's next generation. The job ends with exit 0 and, at
//! depth 0, the uninterrupted model bit for bit. Done for a worker's link
//! and for a shard's.
//!
//! The test creates the namespace and the pair (`ip netns`, `ip link`:
//! root and iproute2) and removes them; where namespaces cannot be made it
//! is skipped, saying so.

mod common;

use common::{Log, Scenario, scenario, sparrow, wait_with_timeout};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const TOKEN: &str = "partition-test-token";

/// A network namespace and the veth pair joining it to this one: the host
/// end `host_if` (address `host_ip`) here, the other end in the namespace
/// (address `ns_ip`). Removed on drop.
struct Netns {
    name: String,
    host_if: String,
    host_ip: String,
    ns_ip: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Netns {
    /// A namespace of this test process; `tag` sets its addresses apart
    /// from another test's (169.254.P.4·tag+1 and +2, P from the pid).
    fn create(tag: u32) -> Result<Netns, String> {
        let pid = std::process::id();
        let name = format!("sparrow-{pid}-{tag}");
        let (host_if, ns_if) = (format!("sph{}{tag}", pid % 100_000), format!("spn{}{tag}", pid % 100_000));
        let block = 1 + pid % 250;
        let (host_ip, ns_ip) = (format!("169.254.{block}.{}", 4 * tag + 1), format!("169.254.{block}.{}", 4 * tag + 2));
        ip(&["netns", "add", &name])?;
        let netns = Netns { name, host_if, host_ip, ns_ip };
        let ns = netns.name.as_str();
        ip(&["link", "add", &netns.host_if, "type", "veth", "peer", "name", &ns_if])?;
        ip(&["link", "set", &ns_if, "netns", ns])?;
        ip(&["addr", "add", &format!("{}/30", netns.host_ip), "dev", &netns.host_if])?;
        ip(&["link", "set", &netns.host_if, "up"])?;
        ip(&["-n", ns, "addr", "add", &format!("{}/30", netns.ns_ip), "dev", &ns_if])?;
        ip(&["-n", ns, "link", "set", &ns_if, "up"])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
        Ok(netns)
    }

    /// The link down (a partition: packets are dropped, nothing is reset) or up.
    fn link(&self, up: bool) {
        ip(&["link", "set", &self.host_if, if up { "up" } else { "down" }]).expect("link");
    }

    /// `sparrow ARGS` inside the namespace.
    fn sparrow(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, env!("CARGO_BIN_EXE_sparrow")]).args(args);
        cmd
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end, and with it the pair.
        let _ = ip(&["netns", "del", &self.name]);
        let _ = ip(&["link", "del", &self.host_if]);
    }
}

/// Which role's link the test cuts.
#[derive(Clone, Copy, PartialEq)]
enum CutOff {
    Worker,
    Shard,
}

/// A job of every role started by hand (the coordinator, two shards, the
/// loader and one worker), `cut` in the namespace and the others here, all
/// on the pair's addresses; its link goes down once a checkpoint is
/// committed, past the heartbeat timeout, and comes back.
fn partition_heals(cut: CutOff, tag: u32) {
    let netns = match Netns::create(tag) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("skipped: network namespaces cannot be made here ({e})");
            return;
        }
    };
    let Scenario { config, whole, tmp: _tmp } = scenario(|text, _| text.replace("epochs = 4", "epochs = 10"));
    let (log, out) = (Log::default(), Log::default());
    // Each child with the reader of its stderr (joined before its last
    // lines are looked for: read at once after its exit, they may be missing).
    let spawn = |mut cmd: Command, name: &str| -> (Child, std::thread::JoinHandle<()>) {
        let mut child = cmd
            .env("SPARROW_AUTH_TOKEN", TOKEN)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let reader = log.collect(child.stderr.take().expect("stderr"));
        (child, reader)
    };
    let here = |args: &[&str]| {
        let mut cmd = sparrow();
        cmd.args(args);
        cmd
    };
    let host = format!("{}:0", netns.host_ip);
    let ns = format!("{}:0", netns.ns_ip);
    let (mut coordinator, _) = spawn(
        here(&["coordinator", "--config", &config, "--shards", "2", "--workers", "1", "--listen", &host]),
        "coordinator",
    );
    out.collect(coordinator.stdout.take().expect("stdout"));
    let address = out.wait_for("coordinator address", Duration::from_secs(20), |l| {
        l.strip_prefix("listening on ").map(str::to_string)
    });
    let role = |kind: &str, index: &str, cut_off: bool| {
        let listen = if cut_off { ns.as_str() } else { host.as_str() };
        let args = [kind, "--coordinator", &address, "--listen", listen, "--index", index];
        let args = if kind == "loader" { &[kind, "--coordinator", &address, "--listen", listen][..] } else { &args };
        let cmd = if cut_off { netns.sparrow(args) } else { here(args) };
        spawn(cmd, kind)
    };
    let (mut shard0, _) = role("shard", "0", false);
    let (mut shard1, _) = role("shard", "1", cut == CutOff::Shard);
    let (mut loader, _) = role("loader", "", false);
    let (mut worker, worker_err) = role("worker", "0", cut == CutOff::Worker);
    let worker_out = Log::default();
    let reader = worker_out.collect(worker.stdout.take().expect("stdout"));
    let wait_for = |needles: &[&str], limit: Duration| log.wait_for_line(needles, limit);
    wait_for(&["checkpoint at step 100 committed"], Duration::from_secs(60));
    netns.link(false);
    // The coordinator takes the cut-off role for dead (past the heartbeat
    // timeout), and the role finds the coordinator silent: both sides of
    // the partition have seen it before the link comes back.
    let lost = match cut {
        CutOff::Worker => "worker 0 at",
        CutOff::Shard => "shard 1 at",
    };
    wait_for(&[lost, "stopped answering"], Duration::from_secs(30));
    wait_for(&["takes this role for dead; trying to rejoin"], Duration::from_secs(30));
    netns.link(true);

    let status = wait_with_timeout(&mut worker, Duration::from_secs(180));
    reader.join().expect("reader");
    worker_err.join().expect("the worker's stderr reader");
    let text = log.text();
    assert!(status.success(), "the worker: {status}\n{text}");
    assert!(text.contains("registered again with the coordinator"), "{text}");
    let summary: serde_json::Value =
        serde_json::from_str(worker_out.text().lines().last().unwrap_or_default()).expect("json");
    assert_eq!(summary["test_auc"], whole["test_auc"], "bit for bit the uninterrupted model\n{text}");
    assert_eq!(summary["train_rows"], whole["train_rows"]);
    assert_eq!(summary["embedding_rows"], whole["embedding_rows"]);
    for (name, child) in [("coordinator", &mut coordinator), ("shard 0", &mut shard0), ("shard 1", &mut shard1)] {
        assert!(wait_with_timeout(child, Duration::from_secs(30)).success(), "{name}\n{text}");
    }
    assert!(wait_with_timeout(&mut loader, Duration::from_secs(30)).success(), "loader\n{text}");
}

#[test]
fn a_workers_link_down_past_the_heartbeat_timeout_heals_with_the_exact_model() {
    partition_heals(CutOff::Worker, 0);
}

#[test]
fn a_shards_link_down_past_the_heartbeat_timeout_heals_with_the_exact_model() {
    partition_heals(CutOff::Shard, 1);
}

/// A role that cannot rejoin (the coordinator gone for good) gives up after
/// the heartbeat timeout and `cluster.connect_timeout_ms` more, with exit
/// code 75, which `launch` and the Kubernetes manifests restart (a restart
/// registers again), not 2, which fails a job.
#[test]
fn a_role_that_cannot_rejoin_exits_75() {
    let Scenario { config, whole: _, tmp: _tmp } = scenario(|text, _| {
        text.replace("epochs = 4", "epochs = 50").replace("[cluster]", "[cluster]\nconnect_timeout_ms = 1000")
    });
    let (log, out) = (Log::default(), Log::default());
    // Each child with the reader of its stderr, joined after its exit: its
    // last line ("giving up") read at once after the exit may be missing.
    let spawn = |args: &[&str]| {
        let mut child = sparrow()
            .args(args)
            .env_remove("SPARROW_AUTH_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("role");
        let reader = log.collect(child.stderr.take().expect("stderr"));
        (child, reader)
    };
    let (mut coordinator, _) =
        spawn(&["coordinator", "--config", &config, "--shards", "1", "--workers", "1", "--listen", "127.0.0.1:0"]);
    out.collect(coordinator.stdout.take().expect("stdout"));
    let address = out.wait_for("coordinator address", Duration::from_secs(20), |l| {
        l.strip_prefix("listening on ").map(str::to_string)
    });
    let shard = spawn(&["shard", "--coordinator", &address, "--index", "0"]);
    let loader = spawn(&["loader", "--coordinator", &address]);
    let worker = spawn(&["worker", "--coordinator", &address, "--index", "0"]);
    log.wait_for_line(&["checkpoint at step 50 committed"], Duration::from_secs(60));
    coordinator.kill().expect("kill the coordinator");
    let _ = coordinator.wait();
    for (name, (mut child, reader)) in [("worker", worker), ("shard", shard), ("loader", loader)] {
        let status = wait_with_timeout(&mut child, Duration::from_secs(60));
        reader.join().expect("stderr reader");
        let text = log.text();
        assert_eq!(status.code(), Some(75), "{name}: {status}\n{text}");
        assert!(text.contains("giving up") && text.contains("registers again and rejoins"), "{text}");
    }
}
