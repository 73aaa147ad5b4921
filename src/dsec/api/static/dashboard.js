// The dsec dashboard: polls /v1/dashboard with the user's key and renders it. Every value is
// put in the page as text (never as HTML): labels and messages come from users.
"use strict";
const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);

function takeKey() {
  const match = location.hash.match(/key=([^&]+)/);
  if (match) {
    sessionStorage.setItem("dsec-key", decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname);  // keep the key out of the address bar
  }
  return sessionStorage.getItem("dsec-key");
}

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text;
  row.appendChild(td);
  return td;
}

function fill(tbody, rows, columns) {
  tbody.replaceChildren();
  for (const r of rows) {
    const tr = document.createElement("tr");
    for (const c of columns) cell(tr, c(r));
    tbody.appendChild(tr);
  }
}

function usageBar(used, quota) {
  const bar = document.createElement("div");
  bar.className = "bar";
  const inner = document.createElement("div");
  inner.style.width = (quota > 0 ? Math.min(100, (100 * used) / quota) : 0) + "%";
  bar.appendChild(inner);
  return bar;
}

function render(d) {
  $("scope").textContent = d.project === null ? "admin view" : "project " + d.project;
  $("updated").textContent = "updated " + new Date(d.generated_at * 1000).toLocaleTimeString();
  $("live-total").textContent = String(d.live_total);
  const nodeRows = [];
  for (const n of d.nodes)
    for (const [substrate, live] of Object.entries(n.substrates))
      nodeRows.push({ edge: n.edge, substrate, live, capacity: n.capacity });
  fill($("nodes"), nodeRows, [(r) => r.edge, (r) => r.substrate, (r) => String(r.live), (r) => String(r.capacity)]);

  const lat = d.create_latency;
  $("latency-count").textContent = String(lat.count);
  $("latency-mean").textContent = lat.count ? ((1000 * lat.sum_s) / lat.count).toFixed(0) + " ms" : "-";
  const most = Math.max(1, ...lat.buckets.map((b) => b.count));
  const hist = $("latency"), labels = $("latency-labels");
  hist.replaceChildren();
  labels.replaceChildren();
  for (const b of lat.buckets) {
    const bar = document.createElement("div");
    bar.style.height = (100 * b.count) / most + "%";
    bar.title = b.count + " creates";
    bar.dataset.count = String(b.count);
    hist.appendChild(bar);
    const label = document.createElement("span");
    label.textContent = b.le === null ? "+inf" : b.le < 1 ? b.le * 1000 + "ms" : b.le + "s";
    labels.appendChild(label);
  }

  const tbody = $("projects");
  tbody.replaceChildren();
  for (const p of d.projects) {
    const tr = document.createElement("tr");
    tr.dataset.project = p.name;
    cell(tr, p.name);
    cell(tr, p.parent === null ? "-" : p.parent);
    cell(tr, p.used.sandboxes + " / " + p.quota.sandboxes);
    cell(tr, p.used.cpu + " / " + p.quota.cpu);
    cell(tr, p.used.memory_mb + " / " + p.quota.memory_mb);
    cell(tr, "").appendChild(usageBar(p.used.sandboxes + p.delegated.sandboxes, p.quota.sandboxes));
    tbody.appendChild(tr);
  }
  fill($("failures"), d.failures, [
    (f) => new Date(f.at * 1000).toLocaleTimeString(), (f) => f.project,
    (f) => f.sandbox_id || "-", (f) => f.code, (f) => f.message]);
}

function showLogin(message) {
  $("data").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
}

async function poll() {
  const key = takeKey();
  if (!key) return showLogin("");
  let response;
  try {
    response = await fetch("/v1/dashboard", { headers: { authorization: "Bearer " + key } });
  } catch (err) {
    $("updated").textContent = "server unreachable; retrying";
    return setTimeout(poll, POLL_MS);
  }
  if (response.status === 401) {
    sessionStorage.removeItem("dsec-key");
    return showLogin("That key is not valid.");
  }
  if (!response.ok) {
    $("updated").textContent = "error " + response.status + "; retrying";
    return setTimeout(poll, POLL_MS);
  }
  render(await response.json());
  $("login").hidden = true;
  $("data").hidden = false;
  setTimeout(poll, POLL_MS);
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("dsec-key", $("key-input").value.trim());
  poll();
});
poll();
