{
  "format": "sluicegate-policy-signatures/1",
  "version": 1,
  "digest": "sha256:74258b206650b1cfe883f245463a4f61b0aa3fecaecd3faf10b125f2abd005e1",
  "signatures": [
    {
      "key_id": "officer-alice",
      "key": "ed25519:AywAB7OMfOpArWZtt5SbbElYZUHlE4eknDFZ2Fsdnw8",
      "sig": "ja1Ak9Ba9JgSOacvf2qLLTdZi1h0wWq6rFFQJ0GV5mMWLjwjC-W96zs8piHQyiswf9V0e4zrL6-xkQTsVGi_CQ"
    },
    {
      "key_id": "officer-bob",
      "key": "ed25519:Mk9R80APMi_aBFwfU0Aj2vNfvIwKC_nPZiRrMbPoBmY",
      "sig": "1u2jY8N53axhlgcJUuUu1FCSI-Sl0ekXS4adYdGOOpYp1jMdCfny7NdQecOoxKiBvL_9oYxf44dtx0Vuuu5oBA"
    }
  ]
}
