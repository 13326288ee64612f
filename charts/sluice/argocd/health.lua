-- Argo CD health check for sluice.dev/InferenceEndpoint.
-- Install: argocd-cm key `resource.customizations.health.sluice.dev_InferenceEndpoint` (docs/operator.md).
--
--   status.phase               Argo CD health
--   Ready, Idle                Healthy      (Idle: scaled to zero, wakes on demand)
--   Pending, Loading,          Progressing
--     Progressing, missing
--   Degraded, Failed           Degraded     (message from the Degraded or Ready condition)
--   anything else              Unknown
-- A status older than the spec (status.observedGeneration < metadata.generation) is Progressing: the
-- operator has not acted on the latest change yet.

local HEALTHY = { Ready = true, Idle = true }
local PROGRESSING = { Pending = true, Loading = true, Progressing = true }
local DEGRADED = { Degraded = true, Failed = true }

local function condition(status, ctype)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == ctype then
      return c
    end
  end
  return nil
end

local function describe(c)
  if c == nil then
    return nil
  end
  if c.reason ~= nil and c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  if c.message ~= nil and c.message ~= "" then
    return c.message
  end
  return c.reason
end

-- The most telling message: a true Degraded condition, then a Ready condition that is not true,
-- then any condition that is not true and says something.
local function problem(status)
  local degraded = condition(status, "Degraded")
  if degraded ~= nil and degraded.status == "True" and describe(degraded) ~= nil then
    return describe(degraded)
  end
  local ready = condition(status, "Ready")
  if ready ~= nil and ready.status ~= "True" and describe(ready) ~= nil then
    return describe(ready)
  end
  if status.conditions ~= nil then
    for _, c in ipairs(status.conditions) do
      if c.status ~= "True" and c.type ~= "Degraded" and describe(c) ~= nil then
        return c.type .. ": " .. describe(c)
      end
    end
  end
  return nil
end

local function health(o)
  local hs = {}
  local status = o.status
  if status == nil or status.phase == nil then
    hs.status = "Progressing"
    hs.message = "Waiting for the Sluice operator to report status"
    return hs
  end
  local phase = status.phase
  local generation = o.metadata ~= nil and o.metadata.generation or nil
  local observed = status.observedGeneration
  if generation ~= nil and observed ~= nil and observed < generation then
    hs.status = "Progressing"
    hs.message = "Waiting for the operator to act on generation " .. tostring(generation)
      .. " (status is of " .. tostring(observed) .. ")"
    return hs
  end
  if HEALTHY[phase] then
    hs.status = "Healthy"
    if phase == "Idle" then
      hs.message = "Scaled to zero; starts on the next request"
    else
      hs.message = "Serving"
      if status.url ~= nil then
        hs.message = "Serving at " .. status.url
      end
    end
  elseif PROGRESSING[phase] then
    hs.status = "Progressing"
    hs.message = problem(status) or phase
  elseif DEGRADED[phase] then
    hs.status = "Degraded"
    hs.message = problem(status) or phase
  else
    hs.status = "Unknown"
    hs.message = "Unknown phase " .. tostring(phase)
  end
  return hs
end

return health(obj)
