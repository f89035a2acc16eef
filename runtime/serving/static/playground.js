// The mars-edge playground: chat and compare over the server's own OpenAI routes.
// Plain JS, no framework, no build step. Model text only ever enters the page as text
// nodes (textContent), never as HTML.
"use strict";

const METRICS_EVERY_MS = 3000;
const KEY_STORAGE = "mars-edge-api-key";

const $ = (id) => document.getElementById(id);
const turns = [];  // chat turns: {role, content}
let chatRequest = null;  // the AbortController of the chat answer streaming now, if any

// ---- settings -------------------------------------------------------------------

function showTau(slider, output) {
  const update = () => { output.textContent = Number(slider.value).toFixed(2); };
  slider.addEventListener("input", update);
  update();
}

// Lookup drafts are checked against the argmax, in the modes that verify drafts; the server
// refuses them otherwise (runtime/decode/params.py). There the page sends draft "masks", shows
// it in the disabled select, says why, and gives back the user's choice once allowed again.
const GREEDY_BELOW = 1e-5;  // runtime.decode.sampling.is_greedy
let draftChoice = "both";   // the user's draft source while the settings allow masks only
let draftAbout = "";        // the note's text while every draft source is allowed

// Why the settings allow draft "masks" only, or null when they allow every draft source.
function draftBlocked() {
  if ($("mode").value === "ar") {
    return "Mode AR feeds no drafts, so masks only is sent: choose threshold or verify to use lookup drafts.";
  }
  const temperature = Number($("temperature").value);
  if (!(temperature < GREEDY_BELOW)) {
    return `Lookup drafts are greedy only, so at temperature ${temperature} masks only is sent: ` +
           "set temperature 0 to use them.";
  }
  return null;
}

function syncDraft() {
  const select = $("draft");
  const note = $("draft-note");
  const blocked = draftBlocked();
  if (blocked !== null && !select.disabled) {
    draftChoice = select.value;
    select.value = "masks";
  } else if (blocked === null && select.disabled) {
    select.value = draftChoice;
  }
  select.disabled = blocked !== null;
  note.textContent = blocked === null ? draftAbout : blocked;
  note.classList.toggle("blocked", blocked !== null);
}

// Adaptive masks act only where a step may be narrower than W (runtime.decode.admission.why_no_adaptive_masks);
// elsewhere (the block scheme, a TensorRT engine, a fixed-window bundle) the server refuses them with a 400.
// /health gives that refusal beforehand: the page then disables the box, unticked, with the reason under it
// and as the tooltip of its label (a disabled input shows none of its own).
let adaptiveAbout = "";  // the note's text where adaptive masks act

function showAdaptiveMasks(health) {
  const box = $("adaptive-masks");
  const note = $("adaptive-masks-note");
  const why = health.why_no_adaptive_masks || null;  // null also from a server that does not say
  if (why !== null) box.checked = false;
  box.disabled = why !== null;
  box.closest("label").title = why || "";
  note.textContent = why || adaptiveAbout;
  note.classList.toggle("blocked", why !== null);
}

// The chat's tau: the server's default (sent as no tau, so each request follows the live default,
// which the load policy may lower) while "follow" is checked; the slider's value once the user moves it.
function followServerTau() {
  const follow = $("tau-follow");
  follow.addEventListener("change", () => { if (follow.checked) showServerTau(); });
  $("tau").addEventListener("input", () => { follow.checked = false; });
}

// While following, put the server's default tau (from the last /metrics) on the slider.
function showServerTau() {
  const tau = Number($("server-status").dataset.defaultTau);
  if (!$("tau-follow").checked || !Number.isFinite(tau)) return;
  $("tau").value = String(tau);
  $("tau-value").textContent = tau.toFixed(2);
}

function chatTau() {
  return $("tau-follow").checked ? null : Number($("tau").value);
}

// The body fields of a request at the given tau (null: the server's default), from the settings panel.
function requestFields(tau) {
  const fields = {
    mode: $("mode").value,
    draft: $("draft").value,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
  if (tau !== null) fields.tau = tau;
  if ($("adaptive-masks").checked) fields.adaptive_masks = true;
  if ($("block-size").value !== "") fields.block_size = Number($("block-size").value);
  return fields;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// ---- one answer: an element that fills as the stream comes ------------------------

function makeAnswer(parent, label) {
  const box = document.createElement("div");
  box.className = "answer";
  box.dataset.state = "streaming";
  const head = document.createElement("div");
  head.className = "answer-label";
  head.textContent = label;
  const text = document.createElement("div");
  text.className = "text";
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = "waiting for the first token…";
  box.append(head, text, stats);
  parent.append(box);
  return box;
}

// Append one streamed chunk's text, shaded by the tokens its forward(s) accepted.
function appendStep(answer, content, stepTokens) {
  if (!content) return;
  const span = document.createElement("span");
  span.className = "step";
  const most = stepTokens.length ? Math.max(...stepTokens) : 1;
  span.dataset.level = String(Math.min(Math.max(most, 1), 4));
  span.dataset.tokens = stepTokens.join("+");
  span.title = stepTokens.length === 1 ? `${most} token(s) in one forward`
                                       : `forwards accepting ${stepTokens.join(" + ")} tokens`;
  span.textContent = content;
  answer.querySelector(".text").append(span);
  answer.scrollIntoView({ block: "nearest" });
}

function showStats(answer, s) {
  const stats = answer.querySelector(".stats");
  stats.replaceChildren();
  const items = [
    ["tpf", "TPF", s.tpf.toFixed(2)],
    ["tps", "decode tok/s", s.decodeRate === null ? "–" : s.decodeRate.toFixed(1)],
    ["ttft", "first token", s.ttftMs === null ? "–" : `${Math.round(s.ttftMs)} ms`],
    ["tokens", "tokens / forwards", `${s.tokens} / ${s.forwards}`],
    ["sent", "sent", s.sent],
  ];
  for (const [cls, name, value] of items) {
    const item = document.createElement("span");
    item.className = "stat";
    const v = document.createElement("b");
    v.className = cls;
    v.textContent = value;
    item.append(name + " ", v);
    stats.append(item);
  }
}

function showError(answer, message) {
  answer.dataset.state = "error";
  const stats = answer.querySelector(".stats");
  stats.replaceChildren();
  const error = document.createElement("div");
  error.className = "error";
  error.setAttribute("role", "alert");
  error.textContent = message;
  stats.append(error);
}

// ---- the request: stream a chat completion into an answer ------------------------

// The error JSON's message ({"error": {"message"}}), or the status line when there is none.
async function errorMessage(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message = `${response.status}: ${body.error.message}`;
  } catch (e) { /* not JSON: the status line says it */ }
  return message;
}

// Server-sent events of one response body, parsed: yields each `data:` payload (JSON or "[DONE]").
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        yield data === "[DONE]" ? data : JSON.parse(data);
      }
    }
  }
}

// Send `messages` at `fields`, stream the answer into `answer`; resolve with its text (null on error
// or when `signal` aborts the request: the server sees the disconnect and frees the KV slot).
async function streamChat(messages, fields, answer, signal) {
  const body = { messages: messages, stream: true, stream_options: { include_usage: true },
                 return_step_tokens: true, ...fields };
  const tau = fields.tau === undefined ? "server default" : fields.tau.toFixed(2);
  const sent = `tau ${tau}, ${fields.mode}, draft ${fields.draft}` +
               (fields.adaptive_masks ? ", adaptive masks" : "") + (fields.block_size ? `, B ${fields.block_size}` : "");
  const started = performance.now();
  let response;
  try {
    response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                                     signal: signal });
  } catch (e) {
    if (e.name === "AbortError") return null;
    showError(answer, `could not reach the server: ${e.message}`);
    return null;
  }
  if (!response.ok) {
    showError(answer, await errorMessage(response));
    return null;
  }
  let text = "", firstAt = null, firstTokens = 0, mars = null, usage = null;
  try {
    for await (const event of events(response)) {
      if (event === "[DONE]") break;
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      const choice = event.choices && event.choices[0];
      if (!choice) continue;
      const steps = (event.mars && event.mars.step_tokens) || [];
      if (choice.finish_reason) mars = event.mars;
      const content = choice.delta.content || "";
      if (content && firstAt === null) {
        firstAt = performance.now();
        firstTokens = steps.reduce((a, b) => a + b, 0);
      }
      text += content;
      appendStep(answer, content, steps);
    }
  } catch (e) {
    if (e.name !== "AbortError") showError(answer, `the server failed mid-answer: ${e.message}`);
    return null;
  }
  const ended = performance.now();
  const tokens = usage ? usage.completion_tokens : 0;
  const decodeSeconds = firstAt === null ? 0 : (ended - firstAt) / 1000;
  showStats(answer, {
    tpf: mars ? mars.tpf : 0,
    forwards: mars ? mars.num_forwards : 0,
    tokens: tokens,
    ttftMs: firstAt === null ? null : firstAt - started,
    decodeRate: decodeSeconds > 0 && tokens > firstTokens ? (tokens - firstTokens) / decodeSeconds : null,
    sent: sent,
  });
  answer.dataset.state = "done";
  refreshStatus();  // the server's gauges now include this answer
  return text;
}

// ---- chat and compare -------------------------------------------------------------

function setBusy(button, busy) {
  button.disabled = busy;
}

async function sendChat(event) {
  event.preventDefault();
  const prompt = $("prompt").value;
  if (!prompt.trim() || $("send").disabled) return;
  setBusy($("send"), true);
  const request = chatRequest = new AbortController();
  const turn = document.createElement("div");
  turn.className = "user";
  turn.textContent = prompt;
  $("transcript").append(turn);
  $("prompt").value = "";
  turns.push({ role: "user", content: prompt });
  const answer = makeAnswer($("transcript"), "assistant");
  const text = await streamChat(turns.slice(), requestFields(chatTau()), answer, request.signal);
  if (request.signal.aborted) return;  // New chat: the page belongs to the next conversation now
  chatRequest = null;
  if (text === null) turns.pop();  // a failed turn is not part of the conversation
  else turns.push({ role: "assistant", content: text });
  setBusy($("send"), false);
  $("prompt").focus();
}

async function runCompare(event) {
  event.preventDefault();
  const prompt = $("compare-prompt").value;
  if (!prompt.trim() || $("compare-run").disabled) return;
  setBusy($("compare-run"), true);
  const messages = [{ role: "user", content: prompt }];
  const runs = [["pane-a", "tau-a", "A"], ["pane-b", "tau-b", "B"]];
  const answers = runs.map(([pane, slider, name]) => {
    $(pane).replaceChildren();
    return makeAnswer($(pane), `${name}: tau ${Number($(slider).value).toFixed(2)}`);
  });
  for (let i = 0; i < runs.length; i++) {
    await streamChat(messages, requestFields(Number($(runs[i][1]).value)), answers[i]);
  }
  setBusy($("compare-run"), false);
}

// New chat: abort the answer streaming now (if any), forget the turns, accept a prompt again.
function newChat() {
  if (chatRequest !== null) chatRequest.abort();
  chatRequest = null;
  turns.length = 0;
  $("transcript").replaceChildren();
  setBusy($("send"), false);
}

function showTab(name) {
  for (const tab of ["chat", "compare"]) {
    $(`${tab}-view`).hidden = tab !== name;
    $(`tab-${tab}`).setAttribute("aria-pressed", String(tab === name));
  }
}

// ---- the server's state: /health once, /metrics every few seconds -----------------

function parseMetrics(text) {
  const values = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const space = line.lastIndexOf(" ");
    values[line.slice(0, space)] = Number(line.slice(space + 1));
  }
  return values;
}

async function refreshStatus() {
  try {
    const response = await fetch("/metrics");
    if (!response.ok) throw new Error(await errorMessage(response));
    const m = parseMetrics(await response.text());
    const status = $("server-status");
    status.dataset.defaultTau = String(m.mars_default_tau);
    showServerTau();
    status.textContent =
      `default tau ${m.mars_default_tau.toFixed(2)} (base ${m.mars_base_tau.toFixed(2)}) · ` +
      `queue ${m.mars_queue_depth} · slots ${m.mars_active_slots}/${m.mars_max_slots} · ` +
      `last 10 s: ${m.mars_tokens_per_second.toFixed(1)} tok/s, TPF ${m.mars_tokens_per_forward.toFixed(2)}`;
  } catch (e) {
    $("server-status").textContent = `server unreachable (${e.message})`;
  }
}

async function loadModel() {
  try {
    const health = await (await fetch("/health")).json();
    $("model-name").textContent = health.model;
    const select = $("block-size");
    select.replaceChildren();
    for (let b = 1; b <= health.block_size; b++) {
      const option = new Option(b === health.block_size ? `${b} (the bundle's)` : String(b), String(b));
      select.append(option);
    }
    select.value = String(health.block_size);
    showAdaptiveMasks(health);
  } catch (e) {
    $("server-status").textContent = `server unreachable (${e.message})`;
  }
}

// ---- wiring ---------------------------------------------------------------------------

function main() {
  showTau($("tau"), $("tau-value"));
  followServerTau();
  showTau($("tau-a"), $("tau-a-value"));
  showTau($("tau-b"), $("tau-b-value"));
  const key = $("api-key");
  key.value = localStorage.getItem(KEY_STORAGE) || "";
  key.addEventListener("input", () => localStorage.setItem(KEY_STORAGE, key.value));
  $("settings").addEventListener("submit", (e) => e.preventDefault());
  draftAbout = $("draft-note").textContent;
  adaptiveAbout = $("adaptive-masks-note").textContent;
  $("mode").addEventListener("change", syncDraft);
  $("temperature").addEventListener("input", syncDraft);
  syncDraft();
  $("chat-form").addEventListener("submit", sendChat);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) sendChat(e);  // not while an IME composes
  });
  $("clear").addEventListener("click", newChat);
  $("compare-form").addEventListener("submit", runCompare);
  $("tab-chat").addEventListener("click", () => showTab("chat"));
  $("tab-compare").addEventListener("click", () => showTab("compare"));
  loadModel();
  refreshStatus();
  setInterval(refreshStatus, METRICS_EVERY_MS);
}

main();
