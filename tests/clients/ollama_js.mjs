// ollama-js (the npm package `ollama`) against a FreeToken server: every call the library
// makes for list, version, show, ps, generate, chat (streamed and not), tools and embed,
// with assertions on what comes back. Prints one JSON summary line; exits non-zero on the
// first failed assertion. Usage: OLLAMA_HOST=http://127.0.0.1:PORT node ollama_js.mjs
import assert from 'node:assert/strict'
import { Ollama } from 'ollama'

const ollama = new Ollama({ host: process.env.OLLAMA_HOST })
const summary = {}
const RFC3339 = /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$/

async function drain(stream) {
  const parts = []
  for await (const part of stream) parts.push(part)
  return parts
}

// GET /api/version
const { version } = await ollama.version()
assert.match(version, /^\d+\.\d+\.\d+/)
summary.version = version

// GET /api/tags
const { models } = await ollama.list()
const names = models.map((m) => m.name)
assert.ok(names.includes('tiny:latest') && names.includes('agent:latest'), names.join(','))
for (const m of models) {
  assert.match(m.digest, /^[0-9a-f]{64}$/)
  assert.ok(m.size > 0 && !Number.isNaN(Date.parse(m.modified_at)))
  assert.equal(m.details.family, 'qwen3moe')
}
summary.models = names

// POST /api/show
const shown = await ollama.show({ model: 'agent' })
assert.ok(shown.capabilities.includes('tools'), JSON.stringify(shown.capabilities))
assert.equal(shown.model_info['qwen3moe.context_length'], 65536)
assert.match(shown.parameters, /tool_choice\s+"?required"?/)
summary.capabilities = shown.capabilities

// POST /api/generate, whole
const gen = await ollama.generate({ model: 'tiny', prompt: 'Why is the sky blue?', options: { seed: 1 } })
assert.equal(gen.done, true)
assert.ok(['stop', 'length'].includes(gen.done_reason), gen.done_reason)
assert.equal(typeof gen.response, 'string')
assert.ok(gen.eval_count > 0 && gen.prompt_eval_count > 0 && gen.total_duration > 0)
assert.match(String(gen.created_at), RFC3339)
assert.ok(Array.isArray(gen.context) && gen.context.length > 0)

// POST /api/generate, streamed: the iterator ends on the `done` chunk
const genParts = await drain(
  await ollama.generate({ model: 'tiny', prompt: 'Tell me a story', stream: true, options: { num_predict: 5 } }),
)
assert.ok(genParts.length >= 2)
assert.ok(genParts.slice(0, -1).every((p) => p.done === false))
assert.equal(genParts.at(-1).done, true)
assert.ok(genParts.at(-1).eval_count <= 5)
summary.generate_chunks = genParts.length

// POST /api/chat, whole
const messages = [{ role: 'user', content: 'Hello there' }]
const chat = await ollama.chat({ model: 'tiny', messages })
assert.equal(chat.done, true)
assert.equal(chat.message.role, 'assistant')
assert.equal(typeof chat.message.content, 'string')

// POST /api/chat, streamed
const chatParts = await drain(await ollama.chat({ model: 'tiny', messages, stream: true }))
assert.ok(chatParts.every((p) => p.message.role === 'assistant'))
assert.equal(chatParts.filter((p) => p.done).length, 1)
assert.equal(chatParts.at(-1).done, true)
assert.ok(['stop', 'length'].includes(chatParts.at(-1).done_reason))
summary.chat_chunks = chatParts.length

// POST /api/chat with tools: the `agent` model must call one (object arguments), streamed
// and not; after the tool's answer it replies in text.
const tools = [
  {
    type: 'function',
    function: {
      name: 'get_weather',
      description: 'The weather in a city',
      parameters: {
        type: 'object',
        properties: { city: { type: 'string', enum: ['Paris', 'Tokyo'] } },
        required: ['city'],
      },
    },
  },
]
const ask = [{ role: 'user', content: 'Weather in Paris?' }]
const called = await ollama.chat({ model: 'agent', messages: ask, tools })
assert.equal(called.message.tool_calls.length, 1)
const call = called.message.tool_calls[0]
assert.equal(call.function.name, 'get_weather')
assert.equal(typeof call.function.arguments, 'object')
assert.ok(['Paris', 'Tokyo'].includes(call.function.arguments.city))
const streamed = await drain(await ollama.chat({ model: 'agent', messages: ask, tools, stream: true }))
const streamedCalls = streamed.flatMap((p) => p.message.tool_calls ?? [])
assert.equal(streamedCalls.length, 1)
assert.equal(streamedCalls[0].function.name, 'get_weather')
assert.equal(streamed.at(-1).done, true)
assert.equal(streamed.at(-1).done_reason, 'stop')
const answered = await ollama.chat({
  model: 'agent',
  tools,
  messages: [...ask, called.message, { role: 'tool', content: '21 °C and sunny', tool_name: 'get_weather' }],
  options: { num_predict: 8 },
})
assert.equal(answered.message.tool_calls, undefined)
assert.equal(answered.done, true)
summary.tool_call = call

// GET /api/ps: both models were loaded by the calls above
const ps = await ollama.ps()
const loaded = ps.models.map((m) => m.name).sort()
assert.deepEqual(loaded, ['agent:latest', 'tiny:latest'])
for (const m of ps.models) {
  assert.ok(!Number.isNaN(Date.parse(m.expires_at)))
  assert.ok(m.context_length > 0)
}
summary.ps = loaded

// POST /api/embed
const emb = await ollama.embed({ model: 'tiny', input: ['first text', 'second text'] })
assert.equal(emb.embeddings.length, 2)
for (const v of emb.embeddings) {
  const norm = Math.sqrt(v.reduce((s, x) => s + x * x, 0))
  assert.ok(Math.abs(norm - 1) < 1e-3, `norm ${norm}`)
}
summary.embedding_dims = emb.embeddings[0].length

// errors come back as exceptions carrying the server's message and status
await assert.rejects(ollama.show({ model: 'nope' }), (e) => e.status_code === 404 && /not found/.test(e.error))
await assert.rejects(
  async () => drain(await ollama.chat({ model: 'nope', messages, stream: true })),
  (e) => e.status_code === 404,
)

console.log(JSON.stringify(summary))
