// FastCosyVoice playground: plain JS, no build step, same-origin calls to the public API.
// `window.playgroundStats` (one object per synthesis) and `window.playground` are read by the
// browser test (tests/integration/test_playground_browser.py).
"use strict";

const PCM_RATE = 24000; // /v1/audio/speech pcm and the WebSocket's pcm_24000: s16le mono
const KEY_STORAGE = "fastcosy.apiKey";
const BASE = location.pathname.replace(/[^/]*$/, ""); // "/" or the app's route prefix + "/"

const $ = (id) => document.getElementById(id);
const state = { player: null, abort: null, recorded: null, recorder: null, ws: null };
window.playground = {
  voicesLoaded: false, info: null, registered: null, ws: null,
  // the AudioContext's state and clock: "running" with time advancing means it is playing out
  audio: () => (state.player && state.player.ctx
    ? { state: state.player.ctx.state, currentTime: state.player.ctx.currentTime } : null),
};

// ------------------------------------------------------------------------------ API helpers
function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

async function errorText(resp) {
  let message = resp.status + " " + resp.statusText;
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) message = resp.status + ": " + body.error.message;
  } catch (_) { /* not the JSON error shape (e.g. Serve's own plain-text answer) */ }
  if (resp.status === 401) message += " (enter an API key above)";
  return message;
}

function setStatus(id, text, kind) {
  const el = $(id);
  el.textContent = text;
  el.className = "status" + (kind ? " " + kind : "");
}

// ------------------------------------------------------------------------------ audio out
// Schedules PCM pieces back to back on one AudioContext as they arrive.
class PcmPlayer {
  constructor() {
    this.ctx = null;
    this.next = 0;
    this.carry = null; // an odd trailing byte waits for its partner
    this.sources = new Set();
  }

  ctxOrNew() {
    if (!this.ctx) this.ctx = new AudioContext();
    return this.ctx;
  }

  start() {
    if (this.ctxOrNew().state === "suspended") this.ctx.resume().catch(() => {});
    this.stop();
  }

  // Returns the number of samples scheduled from these bytes.
  push(bytes) {
    if (this.carry) {
      const joined = new Uint8Array(this.carry.length + bytes.length);
      joined.set(this.carry);
      joined.set(bytes, this.carry.length);
      bytes = joined;
      this.carry = null;
    }
    const n = bytes.length >> 1;
    if (bytes.length & 1) this.carry = bytes.slice(bytes.length - 1);
    if (n === 0) return 0;
    const view = new DataView(bytes.buffer, bytes.byteOffset, n * 2);
    const samples = new Float32Array(n);
    for (let i = 0; i < n; i++) samples[i] = view.getInt16(2 * i, true) / 32768;
    const buffer = this.ctx.createBuffer(1, n, PCM_RATE);
    buffer.copyToChannel(samples, 0);
    const src = this.ctx.createBufferSource();
    src.buffer = buffer;
    src.connect(this.ctx.destination);
    const at = Math.max(this.next, this.ctx.currentTime + 0.05);
    src.start(at);
    this.next = at + buffer.duration;
    this.sources.add(src);
    src.onended = () => this.sources.delete(src);
    return n;
  }

  stop() {
    for (const src of this.sources) {
      try { src.stop(); } catch (_) { /* not started yet */ }
    }
    this.sources.clear();
    this.next = 0;
    this.carry = null;
  }
}

function player() {
  if (!state.player) state.player = new PcmPlayer();
  return state.player;
}

// ------------------------------------------------------------------------------ model info, voices
async function loadInfo() {
  try {
    const resp = await fetch(BASE + "playground/info");
    const info = await resp.json();
    window.playground.info = info;
    const family = info.family || "unknown family";
    if (info.random_weights === true) {
      $("model-line").textContent = "Model: tiny random-weight " + family + " (test model, not speech)";
      $("model-banner").hidden = false;
    } else if (info.random_weights === false) {
      $("model-line").textContent = "Model: " + family + " (trained weights)";
    } else if (info.family) {
      $("model-line").textContent = "Model: " + family + " (whether its weights are trained is not reported)";
    } else {
      $("model-line").textContent = "Model: unknown (no synthesizer answered; reload to ask again)";
    }
  } catch (err) {
    $("model-line").textContent = "Model: unknown (" + err.message + ")";
  }
}

async function loadVoices(select) {
  const resp = await fetch(BASE + "v1/voices", { headers: authHeaders() });
  if (!resp.ok) {
    setStatus("key-status", "Voices: " + (await errorText(resp)), "error");
    return;
  }
  const body = await resp.json();
  const el = $("voice");
  const previous = select || el.value;
  el.replaceChildren();
  const ids = body.voices.map((v) => v.voice_id);
  for (const v of body.voices) {
    const opt = new Option(v.voice_id, v.voice_id);
    opt.title = v.prompt_text;
    el.add(opt);
  }
  const aliases = Object.keys(body.aliases || {});
  if (aliases.length) {
    const group = document.createElement("optgroup");
    group.label = "aliases";
    for (const name of aliases) group.append(new Option(name + " → " + body.aliases[name], name));
    el.add(group);
  }
  if (previous && (ids.includes(previous) || aliases.includes(previous))) el.value = previous;
  else if (ids.includes("default")) el.value = "default";
  setStatus("key-status", ids.length + " voice(s) registered", "ok");
  window.playground.voicesLoaded = true;
}

// ------------------------------------------------------------------------------ synthesis
function newStats() {
  const stats = {
    requests: 1, startedAt: performance.now(), ttfaMs: null, rtf: null, audioSeconds: 0,
    bytes: 0, chunks: 0, samplesScheduled: 0, buffersScheduled: 0,
    // the fetch was still open (its body not finished) when the first buffer was scheduled, and
    // how much of the body arrived after it: audio started while the request was being served
    fetchOpenAtFirstBuffer: null, chunksAfterFirstBuffer: 0, bytesAfterFirstBuffer: 0,
    finished: false, aborted: false, error: null,
  };
  window.playgroundStats = stats;
  return stats;
}

function showStats(stats) {
  $("ttfa").textContent = stats.ttfaMs === null ? "–" : Math.round(stats.ttfaMs) + " ms";
  $("rtf").textContent = stats.rtf === null ? "–" : stats.rtf.toFixed(3);
  $("audio-s").textContent = stats.audioSeconds ? stats.audioSeconds.toFixed(2) + " s" : "–";
}

async function speak() {
  const fmt = $("format").value;
  const speed = Number($("speed").value);
  const stats = newStats();
  showStats(stats);
  setStatus("speak-status", "synthesising…");
  $("play").disabled = true;
  $("stop").disabled = false;
  $("player").hidden = true;
  const abort = new AbortController();
  state.abort = abort;
  if (fmt === "pcm") player().start();
  try {
    const resp = await fetch(BASE + "v1/audio/speech", {
      method: "POST", signal: abort.signal,
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify({ model: "tts-1", input: $("text").value, voice: $("voice").value,
                             response_format: fmt, speed: speed, stream: true }),
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    const reader = resp.body.getReader();
    const parts = [];
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      if (stats.ttfaMs === null) stats.ttfaMs = performance.now() - stats.startedAt;
      stats.bytes += value.length;
      stats.chunks += 1;
      if (fmt !== "pcm") {
        parts.push(value);
        continue;
      }
      if (stats.buffersScheduled > 0) {
        stats.chunksAfterFirstBuffer += 1;
        stats.bytesAfterFirstBuffer += value.length;
      }
      const n = player().push(value);
      if (n > 0) {
        if (stats.buffersScheduled === 0) stats.fetchOpenAtFirstBuffer = true; // reader not done yet
        stats.buffersScheduled += 1;
        stats.samplesScheduled += n;
        stats.audioSeconds = stats.samplesScheduled / PCM_RATE;
        showStats(stats);
      }
    }
    const wall = (performance.now() - stats.startedAt) / 1000;
    if (fmt === "pcm") {
      stats.rtf = stats.audioSeconds ? wall / stats.audioSeconds : null;
    } else {
      await playWhole(parts, fmt, stats, wall);
    }
    stats.finished = true;
    showStats(stats);
    setStatus("speak-status", "done in " + wall.toFixed(2) + " s", "ok");
  } catch (err) {
    if (abort.signal.aborted) {
      stats.aborted = true;
      setStatus("speak-status", "stopped");
    } else {
      stats.error = err.message;
      setStatus("speak-status", err.message, "error");
    }
  } finally {
    state.abort = null;
    $("play").disabled = false;
    $("stop").disabled = true;
  }
}

const MEDIA_TYPES = { mp3: "audio/mpeg", wav: "audio/wav", opus: "audio/ogg", aac: "audio/aac", flac: "audio/flac" };

async function playWhole(parts, fmt, stats, wall) {
  const blob = new Blob(parts, { type: MEDIA_TYPES[fmt] });
  const audio = $("player");
  if (audio.src) URL.revokeObjectURL(audio.src);
  audio.src = URL.createObjectURL(blob);
  audio.hidden = false;
  try {
    const decoded = await player().ctxOrNew().decodeAudioData(await blob.arrayBuffer());
    stats.audioSeconds = decoded.duration;
    stats.rtf = decoded.duration ? wall / decoded.duration : null;
  } catch (_) { /* a container this browser cannot decode: it still downloads from the player */ }
  audio.play().catch(() => {});
}

function stop() {
  if (state.abort) state.abort.abort();
  player().stop();
  $("player").pause();
}

// ------------------------------------------------------------------------------ voice registration
function wavFromBuffer(buffer) {
  // mono 16-bit WAV of an AudioBuffer (channels averaged): what the server's decoder accepts
  const n = buffer.length, rate = buffer.sampleRate;
  const mono = new Float32Array(n);
  for (let c = 0; c < buffer.numberOfChannels; c++) {
    const data = buffer.getChannelData(c);
    for (let i = 0; i < n; i++) mono[i] += data[i] / buffer.numberOfChannels;
  }
  const out = new DataView(new ArrayBuffer(44 + 2 * n));
  const text = (at, s) => { for (let i = 0; i < s.length; i++) out.setUint8(at + i, s.charCodeAt(i)); };
  text(0, "RIFF"); out.setUint32(4, 36 + 2 * n, true); text(8, "WAVE");
  text(12, "fmt "); out.setUint32(16, 16, true); out.setUint16(20, 1, true); out.setUint16(22, 1, true);
  out.setUint32(24, rate, true); out.setUint32(28, 2 * rate, true); out.setUint16(32, 2, true);
  out.setUint16(34, 16, true); text(36, "data"); out.setUint32(40, 2 * n, true);
  for (let i = 0; i < n; i++) out.setInt16(44 + 2 * i, Math.max(-1, Math.min(1, mono[i])) * 32767, true);
  return new Blob([out.buffer], { type: "audio/wav" });
}

async function toggleRecording() {
  if (state.recorder) {
    state.recorder.stop();
    return;
  }
  if (!navigator.mediaDevices || !window.MediaRecorder) {
    $("record-status").textContent = "recording needs https or localhost and MediaRecorder";
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (err) {
    $("record-status").textContent = "no microphone: " + err.message;
    return;
  }
  const chunks = [];
  const recorder = new MediaRecorder(stream);
  state.recorder = recorder;
  recorder.ondataavailable = (e) => { if (e.data.size) chunks.push(e.data); };
  recorder.onstop = async () => {
    for (const track of stream.getTracks()) track.stop();
    state.recorder = null;
    $("record").textContent = "● Record";
    try {
      // MediaRecorder gives WebM/Opus, which the server does not take: decode here, send WAV
      const recorded = new Blob(chunks, { type: recorder.mimeType });
      const decoded = await player().ctxOrNew().decodeAudioData(await recorded.arrayBuffer());
      state.recorded = wavFromBuffer(decoded);
      $("voice-file").value = "";
      $("record-status").textContent = "recorded " + decoded.duration.toFixed(1) + " s (used instead of a file)";
    } catch (err) {
      $("record-status").textContent = "could not decode the recording: " + err.message;
    }
  };
  recorder.start();
  $("record").textContent = "■ Stop recording";
  $("record-status").textContent = "recording… (say the transcript)";
}

async function registerVoice(event) {
  event.preventDefault();
  const file = $("voice-file").files[0];
  const audio = file || state.recorded;
  if (!audio) {
    setStatus("register-status", "choose an audio file or record a clip", "error");
    return;
  }
  const voiceId = $("voice-id").value.trim();
  const form = new FormData();
  form.append("voice_id", voiceId);
  form.append("prompt_text", $("prompt-text").value);
  form.append("audio", audio, file ? file.name : "recording.wav");
  setStatus("register-status", "registering…");
  $("register-submit").disabled = true;
  try {
    const resp = await fetch(BASE + "v1/voices", { method: "POST", headers: authHeaders(), body: form });
    if (!resp.ok) throw new Error(await errorText(resp));
    const info = await resp.json();
    await loadVoices(info.voice_id);
    window.playground.registered = info.voice_id;
    setStatus("register-status", "registered " + info.voice_id + " (" + info.num_prompt_tokens
              + " prompt tokens); selected above", "ok");
  } catch (err) {
    setStatus("register-status", err.message, "error");
  } finally {
    $("register-submit").disabled = false;
  }
}

// ------------------------------------------------------------------------------ text-in WebSocket
function wsControls(open) {
  $("ws-open").disabled = open;
  $("ws-flush").disabled = !open;
  $("ws-end").disabled = !open;
  $("ws-text").disabled = !open;
}

function openSession() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const voice = encodeURIComponent($("voice").value);
  let url = scheme + "//" + location.host + BASE + "v1/text-to-speech/" + voice + "/stream-input?output_format=pcm_24000";
  if (apiKey()) url += "&api_key=" + encodeURIComponent(apiKey());
  const ws = new WebSocket(url);
  const stats = { sentChars: 0, firstTextAt: null, ttfaMs: null, samples: 0, messages: 0, final: false, error: null,
                  closeCode: null };
  window.playground.ws = stats;
  state.ws = { socket: ws, sent: "" };
  player().start();
  $("ws-text").value = "";
  $("ws-ttfa").textContent = "–";
  $("ws-audio-s").textContent = "–";
  setStatus("ws-status", "connecting…");
  ws.onopen = () => {
    ws.send(JSON.stringify({ text: " ", voice_settings: { speed: Number($("speed").value) } }));
    wsControls(true);
    setStatus("ws-status", "open: type text below");
    $("ws-text").focus();
  };
  ws.onmessage = (event) => {
    const data = JSON.parse(event.data);
    stats.messages += 1;
    if (data.error) {
      stats.error = data.error.message;
      setStatus("ws-status", data.error.message, "error");
      return;
    }
    if (data.audio) {
      const raw = atob(data.audio);
      const bytes = new Uint8Array(raw.length);
      for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
      if (stats.ttfaMs === null && stats.firstTextAt !== null) {
        stats.ttfaMs = performance.now() - stats.firstTextAt;
        $("ws-ttfa").textContent = Math.round(stats.ttfaMs) + " ms";
      }
      stats.samples += player().push(bytes);
      $("ws-audio-s").textContent = (stats.samples / PCM_RATE).toFixed(2) + " s";
    }
    if (data.isFinal) stats.final = true;
  };
  ws.onclose = (event) => {
    stats.closeCode = event.code;
    wsControls(false);
    state.ws = null;
    if (!stats.error) {
      setStatus("ws-status", stats.final ? "session ended" : "closed (" + event.code + " " + event.reason + ")",
                stats.final ? "ok" : "error");
    }
  };
}

function sendTyped() {
  // what was typed since the last message; an edit of text already sent starts over from here
  const session = state.ws;
  if (!session || session.socket.readyState !== WebSocket.OPEN) return;
  const value = $("ws-text").value;
  if (!value.startsWith(session.sent)) {
    session.sent = value;
    return;
  }
  const piece = value.slice(session.sent.length);
  if (!piece) return;
  session.socket.send(JSON.stringify({ text: piece }));
  session.sent = value;
  const stats = window.playground.ws;
  stats.sentChars += piece.length;
  if (stats.firstTextAt === null) stats.firstTextAt = performance.now();
}

function wsSend(message) {
  if (state.ws && state.ws.socket.readyState === WebSocket.OPEN) state.ws.socket.send(JSON.stringify(message));
}

// ------------------------------------------------------------------------------ wiring
function init() {
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("api-key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    loadVoices();
  });
  $("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    $("api-key").value = "";
    setStatus("key-status", "key forgotten");
  });
  $("voices-reload").addEventListener("click", () => loadVoices());
  $("play").addEventListener("click", speak);
  $("stop").addEventListener("click", stop);
  $("record").addEventListener("click", toggleRecording);
  $("voice-file").addEventListener("change", () => {
    state.recorded = null;
    $("record-status").textContent = "";
  });
  $("register-form").addEventListener("submit", registerVoice);
  $("ws-open").addEventListener("click", openSession);
  $("ws-text").addEventListener("input", sendTyped);
  $("ws-flush").addEventListener("click", () => wsSend({ text: " ", flush: true }));
  $("ws-end").addEventListener("click", () => {
    sendTyped();
    wsSend({ text: "" });
  });
  loadInfo();
  loadVoices();
}

init();
