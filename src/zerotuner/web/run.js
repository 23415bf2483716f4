// The run page: polls /api/run and draws it. Read-only: it never posts anything.
"use strict";

const GIB = 1024 ** 3;
const $ = (selector) => document.querySelector(selector);

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  const s = Math.round(seconds);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  return h ? `${h}h ${m}m` : m ? `${m}m ${s % 60}s` : `${s}s`;
}

function showPlan(plan) {
  const body = $("#plan-table tbody");
  body.replaceChildren();
  $("#plan-reasons").replaceChildren();
  if (!plan) return;
  $("#plan-hardware").textContent = plan.hardware;
  fillPlanTable(body, plan);
  for (const reason of plan.reasons) {
    const li = document.createElement("li");
    li.textContent = reason;
    $("#plan-reasons").append(li);
  }
}

function showSamples(samples) {
  const box = $("#samples");
  if (!samples) {
    box.textContent = "no samples yet (ZT_VALIDATION_PROMPTS, every ZT_VALIDATION_EVERY_STEPS)";
    $("#samples-step").textContent = "";
    return;
  }
  $("#samples-step").textContent = "step " + samples.step;
  const wanted = samples.images.map((i) => i.video || i.url).join(" ");
  if (box.dataset.shown === wanted) return; // unchanged: keep the images, no flicker
  box.dataset.shown = wanted;
  box.replaceChildren();
  for (const image of samples.images) {
    const figure = document.createElement("figure");
    const caption = document.createElement("figcaption");
    caption.textContent = image.prompt;
    if (image.input) { // the input image it sampled from (image-to-video, edit models)
      const input = document.createElement("img");
      input.src = image.input;
      input.alt = input.title = "input image: " + image.prompt;
      input.className = "input";
      figure.append(input);
    }
    if (image.video) { // a video family's clip; its contact sheet is the poster and a link
      const video = document.createElement("video");
      video.controls = video.loop = video.muted = video.defaultMuted = video.playsInline = true;
      video.preload = "auto";
      video.poster = image.url;
      video.src = image.video;
      video.title = image.prompt;
      const sheet = document.createElement("a");
      sheet.href = image.url;
      sheet.target = "_blank";
      sheet.rel = "noopener";
      sheet.className = "sheet";
      sheet.textContent = "frames";
      caption.append(" ", sheet);
      figure.className = "clip";
      figure.append(video, caption);
    } else {
      const img = document.createElement("img");
      img.src = image.url;
      img.alt = image.prompt;
      figure.append(img, caption);
    }
    box.append(figure);
  }
}

function show(run) {
  $("#phase").textContent = run.phase;
  $("#step").textContent = run.max_steps ? `${run.step} / ${run.max_steps}` : String(run.step);
  $("#eta").textContent = run.phase === "done" ? "done" : duration(run.eta_seconds);
  const loss = run.loss.length ? run.loss[run.loss.length - 1][1] : null;
  $("#last-loss").textContent = loss === null ? "-" : loss.toPrecision(4);
  const job = run.job || {};
  $("#job").textContent = job.family ? `${job.family} ZeRO-${job.zero_stage}, world size ${job.world_size}, ${job.mixed_precision === "no" ? "fp32" : job.mixed_precision}` : "";
  const held = run.eval_loss && run.eval_loss.length ? [{ name: "held-out loss", points: run.eval_loss }] : [];
  lineChart($("#loss-chart"), [{ name: "loss", points: run.loss }, ...held], { xLabel: "step" });
  const ranks = Object.entries(run.ranks);
  const start = ranks.length ? Math.min(...ranks.map(([, s]) => s.t[0] ?? run.now)) : run.now;
  const over = (key, scale) => ranks.map(([rank, s]) => ({
    name: "rank " + rank,
    points: s.t.map((t, i) => [t - start, s[key][i] === null ? null : s[key][i] / scale]),
  }));
  const seconds = { xLabel: "seconds", legend: true };
  lineChart($("#time-chart"), over("step_seconds", 1), seconds);
  lineChart($("#memory-chart"), over("memory_bytes", GIB), { ...seconds, zero: true });
  showSamples(run.samples);
  showPlan(run.plan);
  $("#deepspeed").textContent = run.deepspeed ? JSON.stringify(run.deepspeed, null, 2) : "";
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}

async function poll() {
  try {
    const response = await fetch("/api/run", { cache: "no-store" });
    if (response.ok) show(await response.json());
  } catch (error) {
    $("#phase").textContent = "unreachable"; // the run ended and its server with it
  }
  setTimeout(poll, 2000);
}

poll();
