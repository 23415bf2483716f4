// The builder page: draws the form the server describes, posts it on every change and shows
// what the server's normalizer and planner answer. No configuration logic lives here.
"use strict";

const $ = (selector) => document.querySelector(selector);
let sequence = 0; // answers to older requests are dropped
let timer = null;
let last = null;

function fieldId(name) {
  return "f-" + name.replace(/[^A-Za-z0-9_-]/g, "-");
}

function element(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text) node.textContent = text;
  return node;
}

function drawForm(sections) {
  const form = $("#form");
  for (const section of sections) {
    const set = element("fieldset");
    set.append(element("legend", {}, section.title));
    for (const field of section.fields) set.append(drawField(field));
    form.append(set);
  }
}

function drawField(field) {
  const box = element("div", { class: "field", "data-name": field.name });
  const id = fieldId(field.name);
  const label = element("label", { for: id }, field.label + " ");
  label.append(element("code", {}, field.code || field.name));
  box.append(label);
  let input;
  if (field.kind === "select") {
    input = element("select", { id, name: field.name });
    input.append(element("option", { value: "" }, `default${field.default ? ` (${field.default})` : ""}`));
    for (const choice of field.choices) input.append(element("option", { value: choice }, choice));
  } else if (field.kind === "textarea") {
    input = element("textarea", { id, name: field.name, rows: "3", placeholder: field.default });
  } else {
    input = element("input", { id, name: field.name, placeholder: field.default });
    if (field.choices) {
      const list = element("datalist", { id: id + "-choices" });
      for (const choice of field.choices) list.append(element("option", { value: choice }));
      box.append(list);
      input.setAttribute("list", id + "-choices");
    }
  }
  input.addEventListener("input", schedule);
  input.addEventListener("change", schedule);
  box.append(input);
  box.append(element("div", { class: "help" }, field.help));
  box.append(element("div", { class: "error", role: "alert", hidden: "" }));
  return box;
}

function collect() {
  const form = { settings: {}, deepspeed: {}, hardware: {} };
  for (const input of document.querySelectorAll("#form [name]")) {
    const name = input.name;
    if (name.startsWith("hw.")) form.hardware[name.slice(3)] = input.value;
    else if (name.startsWith("ds.")) form.deepspeed[name.slice(3)] = input.value;
    else form.settings[name] = input.value;
  }
  return form;
}

function fill(form) {
  const values = {};
  for (const [k, v] of Object.entries(form.settings || {})) values[k] = v;
  for (const [k, v] of Object.entries(form.deepspeed || {})) values["ds." + k.replace(/^ds\./, "")] = v;
  for (const [k, v] of Object.entries(form.hardware || {})) values["hw." + k] = v;
  for (const input of document.querySelectorAll("#form [name]")) {
    let value = values[input.name] ?? "";
    if (input.name === "ZT_VALIDATION_PROMPTS" && value.trim().startsWith("[")) {
      try { value = JSON.parse(value).join("\n"); } catch (e) { /* shown as typed */ }
    }
    input.value = value;
  }
}

function schedule() {
  clearTimeout(timer);
  document.body.dataset.pending = "1"; // until the answer to the last change is shown
  timer = setTimeout(() => { timer = null; evaluate(); }, 250);
}

async function post(path, body, method = "POST") {
  const response = await fetch(path, {
    method, headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  return [response.ok, await response.json()];
}

async function evaluate() {
  const mine = ++sequence;
  $("#status").textContent = "checking...";
  const [, answer] = await post("/api/evaluate", collect());
  if (mine !== sequence) return;
  last = answer;
  show(answer);
  if (timer === null) document.body.dataset.pending = "0";
}

function show(answer) {
  for (const box of document.querySelectorAll(".field .error")) {
    box.hidden = true;
    box.textContent = "";
    box.parentElement.classList.remove("invalid");
  }
  const general = $("#general-errors");
  general.replaceChildren();
  for (const error of answer.errors || []) {
    const boxes = error.fields.map((name) => document.querySelector(`.field[data-name="${name}"]`)).filter(Boolean);
    for (const box of boxes) {
      const slot = box.querySelector(".error");
      slot.hidden = false;
      slot.textContent = (slot.textContent ? slot.textContent + "\n" : "") + "error: " + error.line;
      box.classList.add("invalid");
    }
    if (!boxes.length) general.append(element("li", {}, "error: " + error.line));
  }
  const ok = answer.exit_code === 0;
  $("#status").textContent = ok ? "valid: zerotuner config exits 0" : `invalid: zerotuner config exits ${answer.exit_code}`;
  $("#status").className = "status " + (ok ? "ok" : "bad");
  $("#preview").textContent = answer.config ? JSON.stringify(answer.config, null, 2) : "";
  $("#described").textContent = answer.described ? "for " + answer.described : "for this machine";
  showNotes(answer.notes || []);
  showPlan(answer);
  document.body.dataset.evaluations = String(Number(document.body.dataset.evaluations || 0) + 1);
}

function showNotes(notes) {
  const every = $("#show-info").checked;
  const list = $("#notes");
  list.replaceChildren();
  for (const note of notes) {
    if (note.level === "info" && !every) continue;
    list.append(element("li", { class: note.level }, `${note.level}: ${note.message}`));
  }
}

function showPlan(answer) {
  const body = $("#plan-table tbody");
  body.replaceChildren();
  const errors = $("#plan-errors");
  errors.replaceChildren();
  for (const error of answer.plan_errors || []) errors.append(element("li", {}, "error: " + error.line));
  const plan = answer.plan;
  $("#plan-choice").textContent = "";
  $("#plan-reasons").replaceChildren();
  $("#plan-hardware").textContent = plan ? plan.hardware : "";
  if (!plan) return;
  const chosen = fillPlanTable(body, plan);
  $("#plan-choice").textContent = "choice: " + (chosen ? chosen.label : JSON.stringify(plan.choice));
  for (const reason of plan.reasons) $("#plan-reasons").append(element("li", {}, reason));
  for (const warning of plan.warnings) $("#plan-reasons").append(element("li", { class: "warning" }, "warning: " + warning));
}

async function exportAs(format) {
  const status = $("#export-status");
  const [ok, answer] = await post("/api/export/" + format, collect());
  if (!ok) {
    status.textContent = answer.errors.map((e) => "error: " + e.line).join("\n");
    status.className = "small bad";
    return;
  }
  const link = element("a", { download: answer.filename });
  link.href = URL.createObjectURL(new Blob([answer.text], { type: answer.media_type }));
  document.body.append(link);
  link.click();
  link.remove();
  status.textContent = "exported " + answer.filename;
  status.className = "small ok";
}

async function listTemplates(selected) {
  const answer = await (await fetch("/api/templates")).json();
  const list = $("#template-list");
  list.replaceChildren();
  for (const name of answer.names) list.append(element("option", { value: name }, name));
  if (selected) list.value = selected;
}

async function saveTemplate() {
  const name = $("#template-name").value.trim();
  const status = $("#template-status");
  const [ok, answer] = await post("/api/templates/" + encodeURIComponent(name), collect(), "PUT");
  status.textContent = ok ? "saved " + answer.saved : answer.errors.map((e) => "error: " + e.line).join("\n");
  status.className = "small " + (ok ? "ok" : "bad");
  if (ok) await listTemplates(name);
}

async function loadTemplate() {
  const name = $("#template-list").value;
  const status = $("#template-status");
  if (!name) return;
  const response = await fetch("/api/templates/" + encodeURIComponent(name));
  const answer = await response.json();
  if (!response.ok) {
    status.textContent = answer.errors.map((e) => "error: " + e.line).join("\n");
    status.className = "small bad";
    return;
  }
  fill(answer);
  status.textContent = "loaded " + name;
  status.className = "small ok";
  await evaluate();
}

async function start() {
  drawForm(await (await fetch("/api/fields")).json());
  fill(await (await fetch("/api/initial")).json());
  for (const button of document.querySelectorAll("[data-export]")) {
    button.addEventListener("click", () => exportAs(button.dataset.export));
  }
  $("#show-info").addEventListener("change", () => last && showNotes(last.notes || []));
  $("#template-save").addEventListener("click", saveTemplate);
  $("#template-load").addEventListener("click", loadTemplate);
  await listTemplates();
  await evaluate();
}

start();
