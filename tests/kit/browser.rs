//! A real headless Chromium (Debian `chromium` + `chromedriver`, installed by `scripts/browser.sh`), driven over
//! WebDriver, for the operator console's browser tests: the platform's (`tests/platform/console.rs`) and the
//! server's (`server/tests/api/ui.rs`, which includes this file).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;
use uuid::Uuid;

/// The browser, or the reason a test may skip: `None` outside CI when Chromium is missing; under CI (`CI` set, where
/// `scripts/test` installs it) a missing browser fails the test.
pub async fn browser_or_skip() -> Option<Browser> {
    let browser = Browser::start().await;
    if browser.is_none() {
        let why = "the browser test needs Debian's chromium and chromium-driver, not found on PATH (scripts/browser.sh \
                   installs them, as root)";
        assert!(std::env::var_os("CI").is_none(), "{why}");
        eprintln!("SKIPPED: {why}");
    }
    browser
}

/// Chromium under chromedriver, with a profile of its own; both end with it.
pub struct Browser {
    /// The WebDriver session.
    pub client: Client,
    driver: Child,
    profile: PathBuf,
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| p.is_file())
}

impl Browser {
    /// `None` when Debian's `chromium` or `chromedriver` is missing (`scripts/browser.sh` installs them).
    pub async fn start() -> Option<Self> {
        let (chromium, chromedriver) = (which("chromium")?, which("chromedriver")?);
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
        let driver = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let profile = std::env::temp_dir().join(format!("conveyor-ui-chromium-{}", Uuid::new_v4().simple()));
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1280,860",
            &format!("--user-data-dir={}", profile.display()),
        ];
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("browserName".into(), json!("chrome"));
        capabilities.insert("goog:chromeOptions".into(), json!({ "binary": chromium, "args": args }));
        let url = format!("http://127.0.0.1:{port}");
        let client = super::eventually(Duration::from_secs(20), || {
            let (capabilities, url) = (capabilities.clone(), url.clone());
            async move {
                let connector = hyper_util::client::legacy::connect::HttpConnector::new();
                ClientBuilder::new(connector).capabilities(capabilities).connect(&url).await.ok()
            }
        })
        .await
        .expect("chromedriver starts a Chromium session");
        Some(Self { client, driver, profile })
    }

    /// Opens `url`.
    pub async fn goto(&self, url: &str) {
        self.client.goto(url).await.unwrap();
    }

    pub async fn path(&self) -> String {
        let url = self.client.current_url().await.unwrap();
        match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_owned(),
        }
    }

    /// The path once the browser is at `expected`, or the one it is at after 10 s. A click on a form's button can
    /// return before the POST and its redirect have landed, so the page is read once the navigation has.
    pub async fn path_at(&self, expected: &str) -> String {
        let arrived = super::eventually(Duration::from_secs(10), || async {
            let path = self.path().await;
            (path == expected).then_some(path)
        })
        .await;
        match arrived {
            Some(path) => path,
            None => self.path().await,
        }
    }

    /// The element `css` selects, once the page shows one (within 10 s): a click on a form's button can return
    /// before the page it leads to has loaded, so an element of that page is waited for, not looked up once.
    pub async fn element(&self, css: &str) -> fantoccini::elements::Element {
        self.client
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"))
    }

    pub async fn text(&self, css: &str) -> String {
        self.element(css).await.text().await.unwrap()
    }

    pub async fn click(&self, css: &str) {
        self.element(css).await.click().await.unwrap();
    }

    pub async fn type_into(&self, css: &str, text: &str) {
        self.element(css).await.send_keys(text).await.unwrap();
    }

    /// A PNG of the window into `dir`, kept under ~150 KB.
    pub async fn screenshot(&self, dir: &Path, name: &str) {
        let png = self.client.screenshot().await.unwrap();
        assert!(png.starts_with(b"\x89PNG"), "a PNG");
        assert!(png.len() < 150_000, "{name}.png is {} bytes", png.len());
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        // Chromium outlives a killed chromedriver (a test that panicked never closed its session): end the processes
        // that run on this test's own profile, found by it, and only those.
        let flag = format!("--user-data-dir={}", self.profile.display());
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            if cmdline.split(|b| *b == 0).any(|arg| arg == flag.as_bytes()) {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}
