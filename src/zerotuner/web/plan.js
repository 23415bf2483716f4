// The plan table both pages draw (the builder's answer, the run page's plan), in the columns
// `zerotuner plan` prints: the chosen row marked, the rows that do not fit greyed.
"use strict";

const PLAN_CHOICE_KEYS = ["zero_stage", "offload_optimizer", "offload_param",
  "gradient_checkpointing", "offload_activations"];

// The ckpt column: off, on, or where the checkpointed blocks' inputs wait (cpu).
function checkpointing(row) {
  if (!row.gradient_checkpointing) return "off";
  return row.offload_activations === "none" ? "on" : row.offload_activations;
}

function isPlanChoice(row, choice) {
  return PLAN_CHOICE_KEYS.every((key) => row[key] === choice[key]);
}

// Fills `body` (the table's tbody) with the plan's rows; returns the chosen row, if listed.
function fillPlanTable(body, plan) {
  const gib = (bytes) => (bytes / 1024 ** 3).toFixed(1);
  body.replaceChildren();
  let chosen;
  for (const row of plan.rows) {
    const tr = document.createElement("tr");
    if (isPlanChoice(row, plan.choice)) {
      tr.className = "choice";
      chosen = row;
    }
    if (!row.fits) tr.classList.add("unfit");
    for (const text of [row.zero_stage, row.offload_optimizer, row.offload_param,
      checkpointing(row), gib(row.device_bytes), gib(row.host_bytes), gib(row.disk_bytes),
      row.fits ? "yes" : "no"]) {
      const td = document.createElement("td");
      td.textContent = String(text);
      tr.append(td);
    }
    if (row.short) tr.title = row.short.join("; ");
    body.append(tr);
  }
  return chosen;
}
