// The chat page's service worker: installed with the page as llama-server's web UI's is,
// it caches nothing (every answer comes from the server) and passes requests through.
self.addEventListener("install", () => self.skipWaiting());
self.addEventListener("activate", (event) => event.waitUntil(self.clients.claim()));
